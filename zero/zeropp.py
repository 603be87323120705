"""ZeRO++ (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training"): three ways for stage 3 to put fewer bytes on the links that leave a node, each usable on
its own, for dense parameters (over dp) and expert parameters (over edp) alike.

- hpZ (``hpz=True``, stage 3): a secondary partition of the weights over the ranks of one node. The
  forward gathers a block from the primary partition over the whole sharding group, as stage 3
  does, and keeps this rank's 1/k slice of the result (k: the group's members on this node); the
  backward, and any later forward before the weights change, gathers from those slices inside the
  node. Exact: the same values move, bit for bit. Costs a 1/k slice of each block's weights per
  rank from its first forward to the step (k = 1, one member per node: the whole block).
- qwZ (``qwz=True``, stage 3): every all-gather from the primary partition moves the shard
  block-quantized to int8 with one fp32 scale per ``quant_block`` elements
  (``routing_kernels.quantize_blockwise``), dequantized into the compute dtype on arrival; the
  master weights stay fp32 and are never quantized. Without hpZ the backward's gather is quantized
  too, so the backward differentiates the very weights the forward used; with hpZ the secondary
  slices hold those dequantized weights.
- qgZ (``qgz=True``, stages 1-3): the gradients' reduce-scatter becomes DeepSpeed's hierarchical
  quantized all-to-all. Local gradient ``[n nodes, k local ranks, C]`` (chunk (a, b) belongs to
  the member at position b of node a) is reordered to ``[k, n, C]`` so that row b holds what the
  rank at position b reduces; each row is quantized to ``qgz_bits`` (4: two values a byte, or 8)
  with fp32 scales per block, exchanged by an all-to-all inside the node, dequantized and summed in
  fp32 (``[n, C]``: this node's sum of the n chunks at this position); each of those rows is
  re-quantized, exchanged by an all-to-all across nodes among the ranks at the same position, and
  dequantized and summed into this rank's reduce-scatter shard, which the optimizer then sees in
  the compute dtype. A group inside one node skips the second exchange, a group with one member per
  node the first.

The bytes each moves are in ``zero.comm``; the options are checked here before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from routing_kernels import dequantize_blockwise, pack_int4, quantize_blockwise, unpack_int4
from routing_kernels.reference import check_quant_args
from routing_kernels.runtime import group_size

QWZ_BITS = 8


@dataclass(frozen=True)
class ZeroPP:
    hpz: bool = False
    qwz: bool = False
    qgz: bool = False
    qgz_bits: int = 4
    block: int = 256


def check_options(stage: int, layout, *, hpz, qwz, qgz, qgz_bits, quant_block) -> ZeroPP:
    """The options, checked against the stage and the layout; each error names the value and what
    would be valid."""
    for name, v in (("hpz", hpz), ("qwz", qwz), ("qgz", qgz)):
        if not isinstance(v, bool):
            raise ValueError(f"{name}={v!r} must be True or False")
    try:
        check_quant_args(qgz_bits, quant_block)
    except ValueError as e:
        what = "qgz_bits" if "bits=" in str(e) else "quant_block"
        raise ValueError(f"{what}: {e}") from None
    if hpz and stage != 3:
        raise ValueError(
            f"hpz=True needs stage=3 (it partitions stage 3's sharded weights a second time), got stage={stage}"
        )
    if qwz and stage != 3:
        raise ValueError(f"qwz=True needs stage=3 (it quantizes stage 3's weight all-gathers), got stage={stage}")
    if qgz and stage not in (1, 2, 3):
        raise ValueError(
            f"qgz=True needs stage 1, 2 or 3 (it replaces the gradients' reduce-scatter), got stage={stage}, "
            f"which all-reduces them"
        )
    if (hpz or qgz) and layout is not None:
        for kind in ("dp", "edp"):
            if layout.node_split(kind) is None:
                ranks = layout.group_ranks(kind)
                per_node = {}
                for r in ranks:
                    per_node[r // layout.node_size] = per_node.get(r // layout.node_size, 0) + 1
                raise ValueError(
                    f"{'hpz' if hpz else 'qgz'}=True needs every {kind} group to have the same number of members on "
                    f"each node it spans; with node_size={layout.node_size}, dp={layout.dp}, ep={layout.ep} rank "
                    f"{layout.rank}'s {kind} group {ranks} has {per_node} (node: members); choose a node_size that "
                    f"divides dp or a multiple of dp"
                )
    return ZeroPP(hpz=hpz, qwz=qwz, qgz=qgz, qgz_bits=qgz_bits, block=quant_block)


class Pending:
    """A collective in flight and what completes it once it has arrived (``wait()``)."""

    def __init__(self, work=None, *then):
        self.work = work
        self.then = list(then)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        then, self.then = self.then, []
        for f in then:
            f()


# --- wire format: per row, the quantized values then the scales' bytes ----------------------


def _value_bytes(m: int, bits: int) -> int:
    return m if bits == 8 else -(-m // 2)


def row_bytes(m: int, bits: int, block: int) -> int:
    """Bytes one row of ``m`` elements takes on the wire: values, then 4 bytes per block's scale."""
    return _value_bytes(m, bits) + 4 * (-(-m // block))


def pack_rows(rows: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """``rows`` (2-D floats, m per row) -> uint8, ``row_bytes(m)`` per row: each row quantized in its
    own blocks, so each row is one destination's self-contained message."""
    q, s = quantize_blockwise(rows, bits, block)
    values = pack_int4(q) if bits == 4 else q.view(torch.uint8)
    return torch.cat([values, s.view(torch.uint8)], dim=1)


def unpack_rows(buf: torch.Tensor, m: int, bits: int, block: int, dtype=torch.float32) -> torch.Tensor:
    """``pack_rows``'s inverse: the rows' m values each, dequantized in ``dtype``."""
    vb = _value_bytes(m, bits)
    values = buf[:, :vb]
    q = unpack_int4(values, m) if bits == 4 else values.view(torch.int8)
    scales = buf[:, vb:].contiguous().view(torch.float32)
    return dequantize_blockwise(q, scales, block, dtype)


# --- qwZ -------------------------------------------------------------------------------------


def quantized_all_gather(out_P: torch.Tensor, shard_C: torch.Tensor, group, block: int, comm, label: str) -> Pending:
    """Start gathering every rank's ``shard_C`` into ``out_P`` as int8 + fp32 scales (blocks of
    ``block`` within each rank's chunk); ``wait()`` dequantizes into ``out_P``'s dtype. Every
    rank's chunk, its own included, is the dequantized one, so all ranks compute with the same
    weights."""
    W, C = group_size(group), shard_C.numel()
    payload = pack_rows(shard_C.view(1, C), QWZ_BITS, block).view(-1)
    recv = payload.new_empty(W * payload.numel())
    work = comm.all_gather(recv, payload, group, label=label, async_op=True)

    def finish():
        out_P.view(W, C).copy_(unpack_rows(recv.view(W, -1), C, QWZ_BITS, block, out_P.dtype))

    return Pending(work, finish)


# --- qgZ -------------------------------------------------------------------------------------


def quantized_reduce_scatter(
    out_C: torch.Tensor, grad_P: torch.Tensor, *, intra, inter, split: tuple[int, int], bits: int, block: int, comm
) -> Pending:
    """Start reducing ``grad_P`` (this rank's local gradient, ``W * C`` elements) into this rank's
    summed shard ``out_C`` over a group of ``split = (n, k)``: the intra-node all-to-all starts now,
    ``wait()`` finishes it and runs the inter-node one (see the module docstring)."""
    n, k = split
    C = out_C.numel()
    chunks = grad_P.view(n, k, C)  # chunk [a, b]: the shard of the member at position b of node a
    state = {}
    if k > 1:
        send = pack_rows(chunks.transpose(0, 1).reshape(k, n * C), bits, block)
        recv = torch.empty_like(send)
        work = comm.all_to_all(recv, send, intra, label="grad_reduce_intra", async_op=True)
        state["recv"] = recv
    else:
        work = None

    def finish():
        if k > 1:
            part = unpack_rows(state.pop("recv"), n * C, bits, block).sum(0).view(n, C)
        else:
            part = chunks.reshape(n, C).float()
        if n > 1:
            send2 = pack_rows(part, bits, block)
            recv2 = torch.empty_like(send2)
            comm.all_to_all(recv2, send2, inter, label="grad_reduce_inter")
            total = unpack_rows(recv2, C, bits, block).sum(0)
        else:
            total = part[0]
        out_C.copy_(total)

    return Pending(work, finish)
