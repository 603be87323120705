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

    def __init__(self, chunks: dict[str, tuple[int, int]], in_files=None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks
        self.in_files = in_files  # zero.nvme.FileEntries: values read from the offload files per item

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
        if self.in_files is not None and index.fqn in self.in_files:
            return self.in_files.read(index.fqn)
        if index.fqn in self.chunks:
            return self.state_dict[index.fqn]
        return super().lookup_object(index)


class _ChunkLoadPlanner(DefaultLoadPlanner):
    def __init__(self, chunks: dict[str, tuple[int, int]], in_files=None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks
        self.in_files = in_files  # zero.nvme.FileEntries: each read item written to the offload files

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        if self.in_files is None:
            return super().set_up_planner(state_dict, metadata, is_coordinator)
        # DCP's set-up turns meta tensors into empty ones of their size: the whole offloaded state
        # in RAM. The entries in the files stay meta, out of its sight
        kept = {k: state_dict.pop(k) for k in list(state_dict) if k in self.in_files}
        try:
            super().set_up_planner(state_dict, metadata, is_coordinator)
        finally:
            state_dict.update(kept)

    def resolve_tensor(self, read_item):
        if self.in_files is not None and read_item.dest_index.fqn in self.in_files:
            return torch.empty(tuple(read_item.lengths), dtype=self.in_files.dtype(read_item.dest_index.fqn))
        return super().resolve_tensor(read_item)

    def commit_tensor(self, read_item, tensor) -> None:
        if self.in_files is not None and read_item.dest_index.fqn in self.in_files:
            self.in_files.write(read_item.dest_index.fqn, read_item.dest_offsets[0], tensor)
            return
        super().commit_tensor(read_item, tensor)

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
