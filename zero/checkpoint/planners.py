"""DCP planners for 1-D chunks of flattened global tensors: each rank saves, and asks to load, the
chunk of each parameter it holds at its global offset, so DCP reshards between any two layouts."""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    _create_write_items,
    create_read_items_for_chunk_list,
)


class _ChunkSavePlanner(DefaultSavePlanner):
    """``chunks[key] = (global offset, global numel)``: the value under ``key`` is that 1-D chunk
    of a flattened global tensor. Every other key is an ordinary (replicated) tensor."""

    def __init__(self, chunks: dict[str, tuple[int, int]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, t in self.state_dict.items():
            if key in self.chunks:
                offset, numel = self.chunks[key]
                offsets = torch.Size([offset])
                items.append(
                    WriteItem(
                        index=dcp_md.MetadataIndex(key, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=dcp_md.ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                            properties=dcp_md.TensorProperties.create_from_tensor(t),
                            size=torch.Size([numel]),
                        ),
                    )
                )
            else:
                items += _create_write_items(key, t)
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index):
        if index.fqn in self.chunks:
            return self.state_dict[index.fqn]
        return super().lookup_object(index)


class _ChunkLoadPlanner(DefaultLoadPlanner):
    def __init__(self, chunks: dict[str, tuple[int, int]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, t in self.state_dict.items():
            md = self.metadata.state_dict_metadata[key]  # present: checked before the load
            if key in self.chunks:
                chunk = dcp_md.ChunkStorageMetadata(offsets=torch.Size([self.chunks[key][0]]), sizes=t.size())
                items += create_read_items_for_chunk_list(key, md, [chunk])
            else:
                items += _create_read_items(key, md, t)
        return LoadPlan(items)

    def lookup_tensor(self, index):
        if index.fqn in self.chunks:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise ValueError(
            f"checkpoint entry {read_item.dest_index.fqn} holds pickled bytes where a tensor was "
            f"expected; refusing to unpickle it"
        )
