"""Prove, by evaluation on samples, that an identified EP region computes what DeepEP computes.

The index subgraphs between the region's leaves and joints are run (moepass.analysis.evaluate) on:
- 3 routings (random, all on the first experts, all on the last), with token rows that carry their
  token index in base-16 digits and routing weights of 0.5 / 2, so every product and sum is exact even
  in bf16: counts sent == histogram of the ids; input splits == per-rank sums; rows sent == x[token]
  (or x[token] * w[token, k]) for every (token, k) slot exactly once, sorted by expert (this also
  decides where the weights go); the result == sum_k w * returned row (or sum_k returned row).
- 3 received-count patterns (random with zeros, one expert only, nothing): output splits == per-rank
  sums; perm is a permutation grouping received rows by local expert; the rows sent back are the experts'
  output un-permuted by the same perm; the experts' counts == received rows per local expert.
Samples are made on the graph's device in its dtypes and compared there; only counts and split sizes
come to the host. This is evidence on samples plus exact structural conditions, not a symbolic proof.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from moepass.analysis.graph import ancestors, tensor_meta
from moepass.skips import SkipCode
from .ep_parts import EPRegion, Mismatch, expert_counts_candidates, expert_output_candidates
from .evaluate import NotEvaluable
from .evaluate import evaluate as evaluate_at
from .symbols import concrete, concrete_shape, size_expr

NUM_ROUTINGS = 3
SEND, RECEIVE, RESULT = 2, 3, 4  # Mismatch stages: how far a reading of the region got (0-1: identification)
_DIGIT_BASE = 16  # token-index digits: exact in bf16 even after a 0.5 or 2 weight


def check_region(gm: fx.GraphModule, region: EPRegion) -> None:
    """Fill in the experts' output and counts, and decide where the weights apply; raise Mismatch if any
    joint does not compute what the DeepEP rewrite assumes.

    Every rank of the group must decide alike, or they run different collectives and hang: nothing here may
    depend on this rank's token count beyond what is checked on every rank (an empty batch is checked too).
    """
    if region.topk_weights is None or region.tokens_out is None:
        raise Mismatch(region.combine_a2a.node, SkipCode.NOT_IDENTIFIED,
                       "the region's result and routing weights were not identified")
    if region.hidden < 1 + MAX_TOKEN_DIGITS:  # a fixed bar: the token count differs between ranks
        raise Mismatch(region.token_a2a.node, SkipCode.TOO_NARROW,
                       f"hidden size {region.hidden} < {1 + MAX_TOKEN_DIGITS}: too narrow "
                       "to check which token each row carries")
    if region.num_tokens == 0:
        # an empty batch (this rank's alone, maybe): what it sends and its result are empty whatever the index
        # code does; the rows other ranks send here are checked as usual, and where the weights go is read off
        # the graph (weights found on the sent rows), as the other ranks' checks find it
        region.weights_applied = "before_experts" if region.weights_on_sent_rows else "after_experts"
        _check_receive_side(gm, region)
        return
    slots = _check_send_side(gm, region)
    if (region.weights_applied == "before_experts") != region.weights_on_sent_rows:
        raise Mismatch(region.token_a2a.node, SkipCode.WEIGHTS_NOT_SCALING,
                       "routing weights reach the rows sent but do not scale them (or the "
                       "reverse)", stage=SEND)
    _check_receive_side(gm, region)
    _check_tokens_out(gm, region, slots)
    region.checked_routings = NUM_ROUTINGS


MAX_TOKEN_DIGITS = 8  # base-16 digits: up to 2**32 tokens per rank


def token_digits(num_tokens: int) -> int:
    digits = max(1, math.ceil(math.log(max(num_tokens, 2), _DIGIT_BASE)))
    if digits > MAX_TOKEN_DIGITS:
        raise ValueError(f"{num_tokens} rows need more than {MAX_TOKEN_DIGITS} base-16 digits")
    return digits


# ---------------------------------------------------------------- samples


def routings(num_tokens: int, top_k: int, num_experts: int, device, seed: int = 0) -> list[torch.Tensor]:
    """Top-k expert ids [T, K] (distinct per token): random, all on the first experts, all on the last."""
    gen = torch.Generator().manual_seed(seed)
    random_ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(1)[:, :top_k]
    first = torch.arange(top_k).expand(num_tokens, top_k)
    last = (num_experts - 1 - torch.arange(top_k)).expand(num_tokens, top_k)
    return [ids.contiguous().to(device) for ids in (random_ids, first, last)][:NUM_ROUTINGS]


def received_counts(num_ranks: int, local: int, seed: int = 0) -> list[torch.Tensor]:
    """Received counts [W*E_l] (rank-major): random with zeros, one expert only, nothing at all."""
    gen = torch.Generator().manual_seed(seed)
    random_counts = torch.randint(0, 4, (num_ranks * local,), generator=gen)
    one = torch.zeros(num_ranks * local, dtype=torch.int64)
    one[-1] = 5
    return [random_counts, one, torch.zeros_like(one)]


def weights_sample(num_tokens: int, top_k: int, seed: int, device) -> torch.Tensor:
    # powers of two other than 1: every product and sum below is exact, even in bf16
    gen = torch.Generator().manual_seed(seed)
    return torch.tensor([0.5, 2.0])[torch.randint(0, 2, (num_tokens, top_k), generator=gen)].to(device)


def _small_integers(rows: int, width: int, seed: int, device) -> torch.Tensor:
    """Random integers in [-2, 2] (float32), drawn on the device: no host tensor the size of the batch."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(-2, 3, (rows, width), generator=gen, device=device).float()


def x_sample(num_tokens: int, hidden: int, device) -> torch.Tensor:
    """Token t's row: 1, then t in base-16 digits, then small random integers (float32)."""
    t = torch.arange(num_tokens, device=device)
    x = _small_integers(num_tokens, hidden, 1, device)
    x[:, 0] = 1
    for d in range(token_digits(num_tokens)):
        x[:, 1 + d] = ((t // _DIGIT_BASE**d) % _DIGIT_BASE).float()
    return x


def rows_sample(num_rows: int, width: int, device, seed: int = 2) -> torch.Tensor:
    """Small random integer rows whose first column is the row number + 1 (distinct below 256 rows)."""
    rows = _small_integers(num_rows, width, seed, device)
    if width:
        rows[:, 0] = (torch.arange(num_rows, device=device) % 255 + 1).float()
    return rows


def leaf(node: fx.Node, value: torch.Tensor, symbols: dict | None = None) -> torch.Tensor:
    """`value` in the node's shape (when it has one under `symbols`), dtype and device."""
    t, shape = tensor_meta(node), concrete_shape(node, symbols or {})
    if shape is not None and tuple(value.shape) != shape:
        value = value.reshape(shape)
    return value.to(dtype=t.dtype, device=t.device)


def _leaves(region: EPRegion, values: dict) -> dict:
    return {node: leaf(node, value, region.symbols) for node, value in values.items()}


def _evaluate(region: EPRegion, gm, outputs, leaves, **kwargs) -> list:
    return evaluate_at(gm, outputs, leaves, symbols=region.symbols, **kwargs)


def _host(v) -> torch.Tensor:
    return torch.as_tensor(v).detach().cpu()


def _sizes(splits: tuple, values) -> list[int]:
    values = iter(values)
    return [s if isinstance(s, int) else int(next(values)) for s in splits]


def _device(region: EPRegion):
    return tensor_meta(region.x).device


# ---------------------------------------------------------------- send side


def _check_send_side(gm, region: EPRegion) -> list[torch.Tensor]:
    """Counts, split sizes and rows sent match the routing; sets region.weights_applied.

    Returns, per routing, the (token * K + k) slot each sent row carries.
    """
    tok, counts = region.token_a2a, region.counts_a2a
    device, num_tokens, top_k = _device(region), region.num_tokens, region.top_k
    x = x_sample(num_tokens, region.hidden, device)
    split_nodes = [s for s in tok.input_splits if isinstance(s, fx.Node)]
    # splits may be read off one host copy of [sent sums; received sums] (transformers 5): any received counts
    # will do there, and random ones make a real dependence on them fail the split check below
    other_side = _leaves(region, {counts.result: received_counts(region.group_size, region.num_local_experts)[0]})
    weights_applied, slots = None, []
    for i, ids in enumerate(routings(num_tokens, top_k, region.num_experts, device)):
        w = weights_sample(num_tokens, top_k, i, device)
        leaves = _leaves(region, {region.topk_ids: ids, region.topk_weights: w, region.x: x})
        try:
            (sent_counts,) = _evaluate(region, gm, [counts.input], leaves, observe_at=counts.node)
            sent, *splits = _evaluate(region, gm, [tok.input, *split_nodes], {**leaves, **other_side},
                                      observe_at=tok.node)
        except NotEvaluable as e:
            raise Mismatch(tok.node, SkipCode.NOT_COMPUTED_FROM,
                           f"rows or counts sent are not computed from x, expert ids and weights alone: {e}",
                           stage=SEND)
        expected_counts = torch.bincount(_host(ids).reshape(-1), minlength=region.num_experts)
        if not torch.equal(_host(sent_counts).long().reshape(-1), expected_counts):
            raise Mismatch(counts.node, SkipCode.SLOTS_DROPPED,
                           "counts sent are not the number of top-k slots per expert", stage=SEND)
        if _sizes(tok.input_splits, splits) != expected_counts.view(region.group_size, -1).sum(1).tolist():
            raise Mismatch(tok.node, SkipCode.SPLITS_NOT_RANK_SUMS,
                           "input split sizes are not the per-rank sums of the expert counts", stage=SEND)
        here, slot = _sent_slots(sent, ids, w, leaves[region.x].reshape(num_tokens, -1), expected_counts, top_k)
        if here is None or weights_applied not in (None, here):
            raise Mismatch(tok.node, SkipCode.ROWS_NOT_X,
                           "rows sent are not x[token] (or x[token] * its routing weight) "
                           "for every (token, expert) slot, sorted by expert", stage=SEND)
        weights_applied = here
        slots.append(slot)
    region.weights_applied = weights_applied
    return slots


def _sent_slots(sent, ids, w, x, expert_counts, top_k) -> tuple[str | None, torch.Tensor | None]:
    """('before_experts' | 'after_experts', slot of each row) when the rows sent are the slots sorted
    by expert, else (None, None). Compared on the device, in the rows' own dtype (every value is exact)."""
    num_tokens, wrong = ids.shape[0], (None, None)
    if tuple(sent.shape) != (num_tokens * top_k, x.shape[1]):
        return wrong
    scale = sent[:, 0]
    if torch.any(scale == 0):
        return wrong
    digits = token_digits(num_tokens)
    place = torch.tensor([_DIGIT_BASE**d for d in range(digits)], dtype=torch.float64, device=sent.device)
    token = (sent[:, 1:1 + digits].double() / scale.double().unsqueeze(1) * place).sum(1).round().long()
    if token.min() < 0 or token.max() >= num_tokens:
        return wrong
    expert = torch.repeat_interleave(torch.arange(len(expert_counts)), expert_counts).to(sent.device)
    match = ids[token] == expert.unsqueeze(1)
    if not torch.all(match.sum(1) == 1):
        return wrong
    slot = token * top_k + match.long().argmax(1)
    if not torch.equal(torch.sort(slot).values, torch.arange(num_tokens * top_k, device=sent.device)):
        return wrong
    if not torch.equal(sent, x[token].to(sent.dtype) * scale.unsqueeze(1)):
        return wrong
    if torch.all(scale == 1):
        return "after_experts", slot
    if torch.equal(scale.double(), w.double().reshape(-1)[slot]):
        return "before_experts", slot
    return wrong


# ---------------------------------------------------------------- receive side


def _check_receive_side(gm, region: EPRegion) -> None:
    """The experts' input is the received rows grouped by local expert, the rows sent back are the experts'
    output un-permuted, the experts' counts are the per-expert totals; sets region.expert_output and
    region.expert_counts."""
    tok, counts = region.token_a2a, region.counts_a2a
    local, device = region.num_local_experts, _device(region)
    width = concrete(size_expr(tensor_meta(tok.result).shape[1]), region.symbols)
    out_split_nodes = [s for s in tok.output_splits if isinstance(s, fx.Node)]
    samples, sent = [], _sent_counts_sample(region)
    for received in received_counts(region.group_size, local):
        num_rows = int(received.sum())
        rows = x_sample(num_rows, width, device)  # row j carries j in its digits (width >= 9: check_region)
        leaves = _leaves(region, {counts.result: received, tok.result: rows, counts.input: sent})
        try:
            grouped, *splits = _evaluate(region, gm, [region.expert_input, *out_split_nodes], leaves,
                                         forbidden={counts.node})
        except NotEvaluable as e:
            raise Mismatch(tok.node, SkipCode.NOT_COMPUTED_FROM,
                           f"the experts' input is not computed from the received rows and counts alone: {e}",
                           stage=RECEIVE)
        per_rank = received.view(region.group_size, local)
        if _sizes(tok.output_splits, splits) != per_rank.sum(1).tolist():
            raise Mismatch(tok.node, SkipCode.SPLITS_NOT_RANK_SUMS,
                           "output split sizes are not the per-rank sums of the received counts",
                           stage=RECEIVE)
        perm = _row_permutation(grouped, leaves[tok.result])
        if perm is None:
            raise Mismatch(tok.node, SkipCode.NOT_A_PERMUTATION,
                           "the experts' input is not a permutation of the received rows "
                           "(padded, dropped or transformed rows)", stage=RECEIVE)
        expert_of_row = torch.repeat_interleave(torch.arange(local).repeat(region.group_size), received)
        if not torch.all(expert_of_row[perm].diff() >= 0):
            raise Mismatch(tok.node, SkipCode.NOT_GROUPED,
                           "the experts' input does not group the received rows by local expert",
                           stage=RECEIVE)
        samples.append((received, leaves, perm))
    region.expert_output = _pick_expert_output(gm, region, samples)
    region.expert_counts = _pick_expert_counts(gm, region, samples)


def _row_permutation(grouped, rows) -> torch.Tensor | None:
    """perm with grouped == rows[perm], decoded from the row numbers the rows carry; None if there is none."""
    grouped, rows = _host(grouped), _host(rows)
    if grouped.shape != rows.shape:
        return None
    if len(rows) == 0:
        return torch.zeros(0, dtype=torch.long)
    digits = token_digits(len(rows))
    place = torch.tensor([_DIGIT_BASE**d for d in range(digits)], dtype=torch.float64)
    perm = (grouped[:, 1:1 + digits].double() * place).sum(1).round().long()
    if perm.min() < 0 or perm.max() >= len(rows) or not torch.equal(torch.sort(perm).values, torch.arange(len(rows))):
        return None
    return perm if torch.equal(grouped, rows[perm]) else None


def _pick_expert_output(gm, region: EPRegion, samples) -> fx.Node:
    """The latest row tensor y such that the rows sent back are y un-permuted: sent_back[perm] == y."""
    comb = region.combine_a2a
    width = concrete(size_expr(tensor_meta(comb.input).shape[1]), region.symbols)
    for y in expert_output_candidates(region):
        try:
            if all(_unpermutes(gm, region, y, leaves, perm, width) for _, leaves, perm in samples):
                return y
        except NotEvaluable:
            continue
    raise Mismatch(comb.node, SkipCode.NOT_UNPERMUTED,
                   "rows sent back are not the experts' output un-permuted to the received order",
                   stage=RECEIVE)


def _unpermutes(gm, region: EPRegion, y: fx.Node, leaves: dict, perm: torch.Tensor, width: int) -> bool:
    y_value = rows_sample(len(perm), width, _device(region))
    (sent_back,) = _evaluate(region, gm, [region.combine_a2a.input], {**leaves, **_leaves(region, {y: y_value})},
                             forbidden={region.counts_a2a.node, region.expert_input},
                             observe_at=region.combine_a2a.node)
    sent_back = _host(sent_back).float()
    return tuple(sent_back.shape) == (len(perm), width) and torch.equal(sent_back[perm], _host(y_value))


def _pick_expert_counts(gm, region: EPRegion, samples) -> fx.Node | None:
    """The one node through which the received counts reach the experts: rows per local expert."""
    tok, counts = region.token_a2a, region.counts_a2a
    candidates, group_inputs = expert_counts_candidates(region)
    if not candidates and not group_inputs:
        return None  # one local expert reading no group sizes: all its rows are one group
    split_nodes = {n for n in tok.output_splits if isinstance(n, fx.Node)}
    received = {counts.result, tok.result, *split_nodes}
    for c in candidates:
        # the experts' other inputs may mix the group sizes with parameters, but see the received data only
        # through c (the rewrite gives them its own counts in c's place)
        if any(received & ancestors(s, stop={c}) for s in group_inputs):
            continue
        try:
            if all(_counts_per_local_expert(gm, region, c, sample) for sample, _, _ in samples):
                return c
        except NotEvaluable:
            continue
    if any(split_nodes & ancestors(s, stop=split_nodes) for s in group_inputs):
        raise Mismatch(tok.node, SkipCode.READS_ROW_COUNT,
                       "the experts read the received row count, which Dynamo traced as the sum of the "
                       "output split sizes: the DeepEP rewrite cannot supply that value; derive it from "
                       "the group sizes instead (int(group_sizes.sum()))", stage=RECEIVE)
    raise Mismatch(tok.node, SkipCode.GROUP_SIZES,
                   "the experts' group sizes are not the received rows per local expert "
                   "(padded, or not only derived from the received counts)", stage=RECEIVE)


def _sent_counts_sample(region: EPRegion) -> torch.Tensor:
    """Random sent counts, for receive-side slices that pass through a host copy of both sides' sums."""
    return received_counts(region.group_size, region.num_local_experts, seed=1)[0]


def _counts_per_local_expert(gm, region: EPRegion, node: fx.Node, received: torch.Tensor) -> bool:
    counts = region.counts_a2a
    (value,) = _evaluate(region, gm, [node], _leaves(region, {counts.result: received,
                                                              counts.input: _sent_counts_sample(region)}))
    return torch.equal(_host(value).long(), received.view(region.group_size, -1).sum(0))


# ---------------------------------------------------------------- the result


def _check_tokens_out(gm, region: EPRegion, slots: list[torch.Tensor]) -> None:
    """The result is sum_k weight * returned row (weights after experts) or sum_k returned row."""
    comb = region.combine_a2a
    device, num_tokens, top_k = _device(region), region.num_tokens, region.top_k
    width = concrete(size_expr(tensor_meta(comb.input).shape[1]), region.symbols)
    x = x_sample(num_tokens, region.hidden, device)
    for i, ids in enumerate(routings(num_tokens, top_k, region.num_experts, device)):
        w = weights_sample(num_tokens, top_k, i, device)
        returned = _small_integers(num_tokens * top_k, width, 100 + i, device)
        leaves = _leaves(region, {region.topk_ids: ids, region.topk_weights: w, region.x: x, comb.result: returned})
        try:
            (out,) = _evaluate(region, gm, [region.tokens_out], leaves)
        except NotEvaluable as e:
            raise Mismatch(comb.node, SkipCode.NOT_COMPUTED_FROM,
                           f"result is not computed from the returned rows, ids and weights alone: {e}",
                           stage=RESULT)
        # row j came back for the slot sent in row j (the experts' rows are un-permuted before the combine)
        row_of_slot = torch.empty_like(slots[i])
        row_of_slot[slots[i]] = torch.arange(len(slots[i]), device=slots[i].device)
        rows = returned[row_of_slot].view(num_tokens, top_k, width)
        scale = w.unsqueeze(-1) if region.weights_applied == "after_experts" else 1.0
        if not torch.equal(out.reshape(num_tokens, width).float(), (rows * scale).sum(1)):
            where = "after the experts" if region.weights_applied == "after_experts" else "before the experts"
            raise Mismatch(comb.node, SkipCode.NOT_SLOT_SUM, f"result is not the sum of each token's K returned rows "
                           f"(routing weights applied {where})", stage=RESULT)
