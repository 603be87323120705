"""Dispatchers: move token rows to their experts and the results back.

Shapes follow the project's legend (docs/design.md): T tokens, K routing slots, D model dim,
E experts of the model, X experts held by this process (E / ep), R ranks of the expert-parallel
group, S rows in expert order.

Local: routing metadata, then the experts in tokens mode (``routing_kernels.expert_ffn`` permutes,
runs every expert and combines). All-to-All: metadata, permute into global expert order, exchange
counts and rows, the local experts in rows mode, the reverse exchange, combine. Node: each token
crosses to a node at most once, then to its experts inside the node (``NodeDispatcher``). Rows are
never padded to a capacity: split sizes are the real counts, so a dropless layer moves only the rows
it routes.
"""

from __future__ import annotations

import torch

import routing_kernels as rk
from routing_kernels.runtime import all_to_all, all_to_all_single, group_rank, group_size

from .experts import GroupedExperts


class LocalDispatcher:
    """All experts live in this process. Nothing is read on the host: the counts stay on the device
    and ``max_kept`` (``Routing.max_kept``) sizes the rows in expert order."""

    def __call__(
        self,
        x_TD: torch.Tensor,
        expert_ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        experts: GroupedExperts,
        max_kept: int | None = None,
    ) -> torch.Tensor:
        counts_X, _, dest_TK = rk.routing_metadata(expert_ids_TK, experts.num_local)
        return experts(x_TD, counts_X, dest_TK=dest_TK, weights_TK=weights_TK, num_rows=max_kept)


def _chunk_order(counts_RX: torch.Tensor, by_rank_first: bool) -> torch.Tensor:
    """Row permutation between [rank][local expert] and [local expert][rank] chunk orders.

    ``counts_RX[r, x]`` is the number of rows of chunk (r, x). Returns, for each row of the target
    order, its index in the source order; the inverse direction passes ``by_rank_first=False``.
    """
    src_counts = counts_RX if by_rank_first else counts_RX.t()
    src_starts = (torch.cumsum(src_counts.reshape(-1), 0) - src_counts.reshape(-1)).view_as(src_counts)
    # target order visits chunks with the other index outermost
    tgt_counts = src_counts.t().reshape(-1)
    tgt_starts = src_starts.t().reshape(-1)
    total = int(tgt_counts.sum())
    chunk_of_row = torch.repeat_interleave(torch.arange(tgt_counts.numel(), device=counts_RX.device), tgt_counts)
    first_row_of_chunk = torch.cumsum(tgt_counts, 0) - tgt_counts
    within = torch.arange(total, device=counts_RX.device) - first_row_of_chunk[chunk_of_row]
    return tgt_starts[chunk_of_row] + within


class _Gather(torch.autograd.Function):
    # a row permutation; its backward is the inverse permutation
    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        out = torch.empty_like(grad)
        out[index] = grad
        return out, None


class AllToAllDispatcher:
    """Experts split evenly over the ranks of ``ep_group``; rank r owns experts [r*X, (r+1)*X)."""

    def __init__(self, ep_group):
        self.group = ep_group
        # the count exchange stays outside torch.compile's graphs (below); wrapped here rather than
        # by a decorator, since torch.compiler.disable imports dynamo (and triton), which a plain
        # `import moe` must not
        self._exchange = torch.compiler.disable(self._exchange)

    def __call__(self, x_TD, expert_ids_TK, weights_TK, experts: GroupedExperts, max_kept: int | None = None):
        R = group_size(self.group)
        X = experts.num_local
        E = X * R
        me = group_rank(self.group)
        if experts.num_global != E or experts.expert_offset != me * X:
            raise ValueError(
                f"experts hold [{experts.expert_offset}, +{X}) of {experts.num_global}; "
                f"expected rank {me} of {R} to hold [{me * X}, +{X}) of {E}"
            )
        counts_E, _, dest_TK = rk.routing_metadata(expert_ids_TK, E)
        return self._exchange(x_TD, counts_E, dest_TK, weights_TK, experts)

    # The one host read of the MoE path: the All-to-All split sizes are Python ints, and every row
    # count after them depends on the data. torch.compile does not trace this function (one graph
    # break per expert-parallel MoE layer, torch.compiler.disable in __init__); it runs eagerly,
    # local experts included.
    def _exchange(self, x_TD, counts_E, dest_TK, weights_TK, experts: GroupedExperts):
        return _flat_exchange(self.group, x_TD, counts_E, dest_TK, weights_TK, experts)


def _flat_exchange(group, x_TD, counts_E, dest_TK, weights_TK, experts: GroupedExperts):
    """Tokens ``x_TD`` to the experts of ``group``'s ranks (``counts_E`` over the group's experts,
    rank r's the r-th ``experts.num_local``) and their outputs back, combined with ``weights_TK``."""
    R = group_size(group)
    X = experts.num_local
    # 1. exchange counts: recv_RX[r, x] = rows rank r sends to my local expert x
    send_RX = counts_E.view(R, X)
    recv_RX = torch.empty_like(send_RX)
    all_to_all_single(recv_RX, send_RX.contiguous(), None, None, group)
    send_splits = send_RX.sum(1).tolist()
    recv_splits = recv_RX.sum(1).tolist()
    # 2. rows in global-expert order are already grouped by destination rank
    x_SD = rk.permute(x_TD, dest_TK, sum(send_splits))
    x_recv = all_to_all(x_SD, recv_splits, send_splits, group)
    # 3. [source rank][local expert] -> [local expert][source rank]; within an expert the rows
    # then follow global token order, as in the single-process layer
    x_local = _Gather.apply(x_recv, _chunk_order(recv_RX, by_rank_first=True))
    y_local = experts(x_local, recv_RX.sum(0))
    y_recv = _Gather.apply(y_local, _chunk_order(recv_RX, by_rank_first=False))
    y_SD = all_to_all(y_recv, send_splits, recv_splits, group)
    return rk.unpermute_combine(y_SD, dest_TK, weights_TK.to(y_SD.dtype))


class NodeDispatcher:
    """Experts over ``ep_group`` as in ``AllToAllDispatcher``, its R ranks on ``nodes`` of ``members``
    each (group rank = node * members + position); ``intra_group``: this rank's node's members
    (None when there is one), ``inter_group``: the members at this rank's position on every node.

    Each token crosses to a node at most once, however many of its experts the node holds
    (DeepSeek-V3's node-limited dispatch; with group-limited routing whose groups are nodes, at
    most ``topk_groups`` nodes): an All-to-All over ``inter_group`` sends the token's row to the
    member at this rank's position on each node it needs, with the ids and weights of its slots
    there; inside the node ``_flat_exchange`` over ``intra_group`` takes the rows to their experts
    and returns them combined with those weights, one row per token and node, which the reverse
    inter exchange brings home to be summed. The flat dispatcher moves a row per slot over the
    links that leave a node; this one a row per node. Same values as the flat one: each token's
    output is its slots' weighted sum, summed node by node (float rounding aside).

    Names below: a "row" is one (token, node) pair sent (``row_*``, in node order, token order
    within); ``*_recv`` are the rows received from every node."""

    def __init__(self, ep_group, intra_group, inter_group):
        self.group, self.intra, self.inter = ep_group, intra_group, inter_group
        self._exchange = torch.compiler.disable(self._exchange)  # as AllToAllDispatcher's

    def __call__(self, x_TD, expert_ids_TK, weights_TK, experts: GroupedExperts, max_kept: int | None = None):
        R, nodes, members = group_size(self.group), group_size(self.inter), group_size(self.intra)
        X = experts.num_local
        me = group_rank(self.group)
        node, pos = group_rank(self.inter), group_rank(self.intra)
        if nodes * members != R or me != node * members + pos or nodes < 2:
            raise ValueError(
                f"ep group of {R} ranks (this one {me}) with node sub-groups of {members} (position {pos}) and "
                f"{nodes} (node {node}): expected 2 or more nodes of equal members, nodes x members = {R}, "
                f"rank = node x members + position"
            )
        if experts.num_global != X * R or experts.expert_offset != me * X:
            raise ValueError(
                f"experts hold [{experts.expert_offset}, +{X}) of {experts.num_global}; "
                f"expected rank {me} of {R} to hold [{me * X}, +{X}) of {X * R}"
            )
        return self._exchange(x_TD, expert_ids_TK, weights_TK, experts)

    def _exchange(self, x_TD, expert_ids_TK, weights_TK, experts: GroupedExperts):
        nodes, members, X = group_size(self.inter), group_size(self.intra), experts.num_local
        T = x_TD.shape[0]
        per_node = members * X
        ids_TK = expert_ids_TK.long()
        node_TK = torch.where(ids_TK >= 0, ids_TK // per_node, -1)  # dropped slots (-1) go nowhere
        # need[i, t] ([nodes, T + 1]): token t has a slot on node i (a dropped slot marks the spare
        # column T); its nonzeros in row-major order are the rows to send
        need = torch.zeros(nodes, T + 1, dtype=torch.bool, device=x_TD.device)
        token_TK = torch.arange(T, device=x_TD.device)[:, None].expand_as(node_TK)
        need[node_TK.clamp(min=0), torch.where(node_TK >= 0, token_TK, T)] = True
        row_node, row_token = need[:, :T].nonzero(as_tuple=True)
        send_counts = torch.bincount(row_node, minlength=nodes)
        recv_counts = torch.empty_like(send_counts)
        all_to_all_single(recv_counts, send_counts, None, None, self.inter)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        # each row's slots on its node: their ids within the node, the rest dropped (weight 0)
        row_on = node_TK.index_select(0, row_token) == row_node[:, None]
        row_ids = torch.where(row_on, ids_TK.index_select(0, row_token) - row_node[:, None] * per_node, -1)
        row_weights = torch.where(row_on, weights_TK.index_select(0, row_token), 0.0)
        x_recv = all_to_all(x_TD.index_select(0, row_token), recv_splits, send_splits, self.inter)
        weights_recv = all_to_all(row_weights, recv_splits, send_splits, self.inter)
        ids_recv = row_ids.new_empty((sum(recv_splits), row_ids.shape[1]))
        all_to_all_single(ids_recv, row_ids, recv_splits, send_splits, self.inter)
        if members == 1:  # the node is this rank: its experts in tokens mode
            counts_X, _, dest_recv = rk.routing_metadata(ids_recv, X)
            y_recv = experts(x_recv, counts_X, dest_TK=dest_recv, weights_TK=weights_recv.to(x_recv.dtype))
        else:
            counts_node, _, dest_recv = rk.routing_metadata(ids_recv, per_node)
            y_recv = _flat_exchange(self.intra, x_recv, counts_node, dest_recv, weights_recv, experts)
        y_rows = all_to_all(y_recv, send_splits, recv_splits, self.inter)
        return torch.zeros_like(x_TD, dtype=y_rows.dtype).index_add(0, row_token, y_rows)
