"""The bytes each rank sends in one training step, counted as they are sent, beside the
formula for them (make bench; the scripts keep the formulas as comments by their
collectives).

    python tests/bench.py count-comm three_d --p2p-shard

"Bytes sent" by one rank follows the ring algorithm, as the bandwidth table's busbw
does, so a count is exact and can be derived by hand. Over a group of n ranks:
    all-reduce of N bytes            2(n-1)/n x N   (a reduce-scatter, then an all-gather)
    all-gather producing N bytes      (n-1)/n x N   (its own piece, to each of n-1 others)
    reduce-scatter of N input bytes   (n-1)/n x N
    send of N bytes                   N
A group of one sends nothing. Fractions keep the sums exact where n does not divide N.

Each script's step runs here as tests/gpu_path.py builds it from the script's own blocks
(dp_step, tp_blocks, run_schedule, ThreeDRank), on the CPU over gloo, inside
CommCounter.step(), which swaps the torch.distributed functions they call for counting
wrappers and puts the originals back afterwards.
"""
import collections
import contextlib
import inspect
import textwrap
from fractions import Fraction

import torch
import torch.distributed as dist

import data_parallel
import pipeline_parallel
import tensor_parallel
import three_d
from collectives import cleanup, setup, spawn
from collectives import collective_cost
from data_parallel import dp_costs, gather_on_rank0
from pipeline_parallel import pipeline_costs
from tensor_parallel import part_kinds, tp_costs

RING_COST = {  # dist function -> (kind, the argument that holds N, factor)
    "all_reduce": ("all-reduce", "tensor", 2),
    "all_gather_single": ("all-gather", "output_tensor", 1),
    "all_gather_into_tensor": ("all-gather", "output_tensor", 1),
    "reduce_scatter_single": ("reduce-scatter", "input", 1),
    "reduce_scatter_tensor": ("reduce-scatter", "input", 1),
    "all_to_all_single": ("all-to-all", "input", 1),   # even pieces (Ulysses'; not --ep's)
}


class CommCounter:
    """Counts the bytes this rank sends inside `with counter.step():`, per (dimension, kind).

    groups names this rank's group of each parallel dimension: {"tp": tp_group, "pp":
    pp_group, "dp": dp_group} in 3D, {"dp": None} where the world is the one dimension.
    A collective counts for the dimension of the group it runs on, a send for the
    dimension whose group holds the peer. dist.isend stays as it is (P2POp accepts only
    the real one): sends are counted where batch_isend_irecv posts them.
    """

    def __init__(self, groups):
        self.groups = groups
        self.counts = {}   # (dimension, kind) -> [calls, bytes], of the last step()
        self.calls = collections.Counter()   # (dimension, kind, bytes of the tensor) -> calls

    @contextlib.contextmanager
    def step(self):
        self.counts = {}
        self.calls = collections.Counter()
        originals = {name: getattr(dist, name) for name in [*RING_COST, "send", "batch_isend_irecv"]}
        for name, fn in originals.items():
            setattr(dist, name, self._counting(name, fn))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    def _counting(self, name, fn):
        def counted(*args, **kwargs):
            call = inspect.signature(fn).bind(*args, **kwargs).arguments
            if name == "batch_isend_irecv":
                for op in call["p2p_op_list"]:
                    if op.op is dist.isend:          # the receives send nothing
                        self._add(self._dimension(peer=op.peer), "send", nbytes(op.tensor),
                                  nbytes(op.tensor))
            elif name == "send":
                self._add(self._dimension(peer=call["dst"]), "send", nbytes(call["tensor"]),
                          nbytes(call["tensor"]))
            else:
                kind, tensor, factor = RING_COST[name]
                n = dist.get_world_size(call.get("group"))
                self._add(self._dimension(group=call.get("group")), kind,
                          Fraction(factor * (n - 1) * nbytes(call[tensor]), n), nbytes(call[tensor]))
            return fn(*args, **kwargs)
        return counted

    def _add(self, dimension, kind, count, tensor_bytes):
        entry = self.counts.setdefault((dimension, kind), [0, 0])
        entry[0] += 1
        entry[1] += count
        self.calls[dimension, kind, tensor_bytes] += 1

    def _dimension(self, group=None, peer=None):
        """The name of the group a collective runs on, or of the group that holds a peer."""
        world = dist.group.WORLD
        for name, mine in self.groups.items():
            mine = world if mine is None else mine
            if peer is None and mine is (world if group is None else group):
                return name
            if peer is not None and peer in dist.get_process_group_ranks(mine):
                return name
        return "other"   # a group nobody named: the report shows it as unexpected


def nbytes(tensor):
    return tensor.numel() * tensor.element_size()


# ---- the formulas, per rank and step: the scripts' own cost functions --------------

def formula(dimension, runs, n):
    """{(dimension, kind): (bytes, how)} for a step's collectives, (kind, bytes of the tensor,
    times) as a script's cost function gives them, over n ranks (collectives.collective_cost)."""
    out = {}
    for kind, nbytes, times in runs:
        sent, how = out.get((dimension, kind), (0, ""))
        if times:
            how = f"{how} + " * bool(how) + f"{times} x {nbytes}"
        out[dimension, kind] = (sent + times * collective_cost(kind, nbytes, n)[0], how)
    ring = {"all-reduce": "2({n}-1)/{n} x", "send": "", "all-gather": "({n}-1)/{n} x",
            "reduce-scatter": "({n}-1)/{n} x", "all-to-all": "({n}-1)/{n} x"}
    return {key: (sent, f"{ring[key[1]].format(n=n)} ({how or 0})".strip())
            for key, (sent, how) in out.items()}


def three_d_formula(args, stage, tp_rank=0):
    """The rank's collectives by three_d.three_d_costs(), over its tp, pp and dp groups (its
    replica's buckets hold its tp rank's classes of E and H)."""
    runs = three_d.three_d_costs(args, stage, tp_rank=tp_rank)[0]
    sizes = {"tp": args.tp, "pp": args.pp, "dp": args.dp, "cp": args.cp}
    return {key: value for group, group_runs in runs.items()
            for key, value in formula(group, group_runs, sizes[group]).items()}


def style_bytes(num_layers, tp_style, act_bytes, num_micro_batches, tp_size, mlp_bytes):
    """A TP rank's bytes per step over the model's blocks, in one style (tp_costs)."""
    runs = tp_costs(["block"] * num_layers, act_bytes, 0, tp_style, num_micro_batches=num_micro_batches,
                    mlp_bytes=mlp_bytes)
    return sum(sent for sent, _ in formula("tp", runs, tp_size).values())


def megatron_comparison(num_layers, act_bytes, num_micro_batches, tp_size, ffn_ratio):
    """One paragraph: the two TP styles' bytes over the layers, for this run's sizes.

    Per block and micro-batch, with A the bytes of one activation [b, T, D] and F/D the MLP's:
      all-gather style: all-gathers of o, Wo's output, the MLP's F/D A and W2's output (forward),
                        all-reduces of dn1, do, the MLP's F/D A and dn2 (backward)
                        = (3 + F/D) (t-1)/t A + 2 (3 + F/D) (t-1)/t A = 3 (3 + F/D) (t-1)/t A
      Megatron:         two g all-reduces (forward) + two f all-reduces (backward)
                        = 8 (t-1)/t A: 8 / (3 (3 + F/D)) of it
    The ends are the same in both styles: the embedding's all-reduce, the head's, the loss's.
    """
    L, A, m, t = num_layers, act_bytes, num_micro_batches, tp_size
    if t == 1:
        return "Megatron comparison: with --tp 1 neither style sends anything."
    gather, megatron = (style_bytes(L, style, A, m, t, int(A * ffn_ratio))
                        for style in ("all-gather", "megatron"))
    units = Fraction(3 * (3 * ffn_ratio.denominator + ffn_ratio.numerator), ffn_ratio.denominator)
    return (f"TP bytes per rank and step over the model's {L} blocks (t={t}, m={m}, A={A} bytes), by the "
            f"formulas above: the all-gather style {float(gather):.0f}, Megatron's pairs {float(megatron):.0f}, "
            f"{float(megatron / gather):.3f} of it. Per block and micro-batch Megatron sends 8(t-1)/t A "
            f"where the all-gather style sends 3(3 + F/D)(t-1)/t A = {float(units):g}(t-1)/t A. The "
            f"embedding, the head and the loss send the same in both.")


# ---- one counted step of each script -------------------------------------------------

def count_worker(rank, world_size, script, args):
    """One step of the script's rank, as tests/gpu_path.py builds it, counted; then the report."""
    from gpu_path import BUILDERS
    device = setup(rank, world_size)
    dist.barrier()                            # before the first point-to-point (NCCL's rule)
    step, replica, groups, stage = BUILDERS[script](args, rank, world_size, device=device)
    counter = CommCounter(groups)
    with counter.step():
        step()
    m = args.micro_batches
    act_bytes = args.batch_size // m * args.context * args.dim * (2 if args.bf16 else 4)   # [B/m, T, D]
    notes = ""
    if script == "data_parallel":
        runs = dp_costs(replica.lengths, world_size, zero=args.zero, num_micro_batches=m,
                        optimizer=args.optimizer, bf16=args.bf16)[0]
        want = formula("dp", runs, world_size)
    elif script == "tensor_parallel":
        L, head_dim = args.num_layers, args.dim // args.heads
        summed = [4 * head_dim] * 2 * L * args.qk_norm + [4 * args.dim * args.experts] * L * (args.experts > 0)
        if args.sequence_parallel:                                   # the gains, summed
            summed += [4 * args.dim] * (2 * L + 1)
        runs = tp_costs(part_kinds(L), act_bytes, args.batch_size // m * args.context,
                        args.tp_style, num_micro_batches=m, recompute=args.recompute,
                        sequence_parallel=args.sequence_parallel, summed=summed,
                        mlp_bytes=act_bytes * args.ffn_dim // args.dim)
        want = formula("tp", runs, world_size)
        if args.kv_heads < world_size:                               # Wk, Wv over their holders
            want.update(formula("kv", [("all-reduce", 4 * args.dim * head_dim, 2 * L)],
                                world_size // args.kv_heads))
        notes = megatron_comparison(args.num_layers, act_bytes, m, world_size,
                                    Fraction(args.ffn_dim, args.dim))
    elif script == "pipeline_parallel":
        runs = pipeline_costs(args.schedule, world_size, stage, m, args.virtual_stages, act_bytes=act_bytes)[2]
        want = formula("pp", runs, world_size)
    else:
        want = three_d_formula(args, stage, dist.get_rank(groups["tp"]))
        act_bytes = (args.batch_size // (args.dp * m)) * args.context * args.dim * (2 if args.bf16 else 4)
        notes = megatron_comparison(args.num_layers, act_bytes, m, args.tp,
                                    Fraction(args.ffn_dim, args.dim))
    report(counter, want, notes)
    cleanup()


def report(counter, formula, notes=""):
    """On rank 0, every rank's counts from the last step() beside the formula. Every rank
    calls this (it gathers); ranks whose lines are identical share one block."""
    names = [*counter.groups, "other"]
    lines = []
    for key in sorted(set(counter.counts) | set(formula), key=lambda k: (names.index(k[0]), k[1])):
        calls, counted = counter.counts.get(key, (0, 0))
        expected, how = formula.get(key, (0, "not in the formula"))
        verdict = "ok" if counted == expected else "DIFFERENT"
        lines.append(f"    {key[0]} {key[1]:<15}{calls:>4} calls  counted {exact(counted):>10}  "
                     f"formula {exact(expected):>10} = {how}  {verdict}")
    everyone = gather_text("\n".join(lines))
    if everyone is None:
        return
    blocks = {}   # lines -> the ranks that have exactly those
    for rank, theirs in enumerate(everyone):
        blocks.setdefault(theirs, []).append(rank)
    print("count-comm: bytes each rank sent in one training step, counted and by formula\n"
          "  (ring convention over n ranks: all-reduce of N bytes 2(n-1)/n x N, all-gather and reduce-scatter\n"
          "  (n-1)/n x N, send N; the loss's all-reduce, --save and barriers are outside the count)")
    for theirs, ranks in blocks.items():
        print(f"  ranks {','.join(map(str, ranks))}:\n{theirs}")
    if notes:
        print(textwrap.fill(notes, 100, break_on_hyphens=False))
    print(flush=True)


def exact(count):
    """An integer as it is; a fraction of a byte (n does not divide N) to 2 decimals."""
    return str(count) if Fraction(count).denominator == 1 else f"{float(count):.2f}"


def gather_text(text):
    """Every rank's string, in rank order, on rank 0 (None elsewhere), as bytes in tensors:
    torch's object collectives would need numpy."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(data)]))
    padded = torch.zeros(max(int(s) for s in sizes), dtype=torch.uint8)
    padded[:len(data)] = data
    parts = gather_on_rank0(padded)                                  # [ranks, longest]
    return None if parts is None else [bytes(p[:int(s)].tolist()).decode() for p, s in zip(parts, sizes)]


COUNTERS = {"data_parallel": (data_parallel, lambda a: a.world_size),
            "tensor_parallel": (tensor_parallel, lambda a: a.world_size),
            "pipeline_parallel": (pipeline_parallel, lambda a: a.world_size),
            "three_d": (three_d, lambda a: a.dp * a.pp * a.tp)}


def count(script_name, argv):
    """One counted step of a script, with its own command line; rank 0 prints the report."""
    parse([script_name, *argv])()


def parse(argv):   # the script's flags through its door, as a call that counts its step
    if not argv or argv[0] not in COUNTERS:
        raise SystemExit(f"usage: python tests/bench.py count-comm {{{','.join(COUNTERS)}}} [its flags]")
    script, world_size = COUNTERS[argv[0]]
    args = script.parse_args(argv[1:])
    return lambda: spawn(count_worker, world_size(args), argv[0], args, backend=args.backend,
                         timeout_s=args.timeout_s)


def main(argv):
    parse(argv)()
