#!/usr/bin/env python3
"""Step-time and memory model per rank for ShardTrain's strategies (docs/scaling.md).

Plain Python 3, standard library only:

    python3 bench/scaling/scaling_model.py            # every table of docs/scaling.md
    python3 bench/scaling/scaling_model.py --check    # assert the invariants and the calibration
    python3 bench/scaling/scaling_model.py --mfu 0.40 --tokens-per-gpu 4096   # other assumptions

The model, per rank and per optimizer step:
  compute     executed FLOPs / achieved FLOP/s; FLOPs per token = 6 x params + 12 x layers x width x
              sequence (attention, PaLM's convention); activation checkpointing adds one forward (x 4/3)
  collectives alpha-beta ring terms: latency + (W-1)/W x bytes / busbw (all-gather, reduce-scatter),
              2(W-1)/W x bytes / busbw (all-reduce), latency per ring hop
  overlap     an event simulation of one step: a unit's all-gather may run while the unit before it
              computes (prefetch by one unit), a unit's reduce-scatter after its backward, all on one
              link in issue order; HYBRID_SHARD's replicate all-reduce of a unit when its reduce-scatter
              ends, on the replicate group's link; exposed communication = step - compute - optimizer
  tensor par. model_parallel (tp > 1): each rank's pieces of the units (GPT.tp_units) sharded over the
              data-parallel group, the tensor-parallel group's collectives (tp_calls) on the compute stream
  optimizer   AdamW over the parameters this rank owns, memory-bound
  memory      sharded fp32 master + Adam moments + fp32 gradient shard, gathered bf16 units in flight,
              activations (with or without checkpointing), logits
Numbers in CALIB come from docs/benchmarks.md and docs/comm_benchmark.md (commit 88561eb), measured on
a 2-core CPU machine; the H200 numbers in H200 are assumptions, stated in docs/scaling.md.
"""

import argparse
import math
import sys

MiB = 2.0 ** 20
GB = 1e9

# --------------------------------------------------------------------------------------------------
# Models


class GPT:
    """GPT-2-like decoder as examples/gpt (4x MLP, LayerNorm, biases, learned positions, tied head)."""

    def __init__(self, name, n_layer, d, vocab, seq):
        self.name, self.L, self.d, self.V, self.s = name, n_layer, d, vocab, seq

    @property
    def unit(self):  # parameters of one transformer block (one FSDP unit): examples/gpt/gpt_model.cc
        d = self.d
        return 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)

    @property
    def root(self):  # wte (tied head) + wpe + ln_f: the root unit
        return self.V * self.d + self.s * self.d + 2 * self.d

    @property
    def params(self):
        return self.L * self.unit + self.root

    def units(self):
        """[root, block 1..L]: parameters of each unit, in forward order."""
        return [self.root] + [self.unit] * self.L

    def tp_units(self, tp):
        """[root, block 1..L]: parameters one tensor-parallel rank of a group of tp holds, as examples/gpt's
        plan splits them: c_attn and c_fc column-wise (weights and biases), both c_proj row-wise (weights;
        their biases whole), wte over the vocabulary; the LayerNorms, the row-wise biases and wpe whole on
        every rank (with sequence parallelism their gradients are partial and summed over the group)."""
        d = self.d
        block = (12 * d * d + 7 * d) / tp + self.tp_replicated_block()
        root = self.V * d / tp + self.tp_replicated_root()
        return [root] + [block] * self.L

    def tp_replicated_block(self):  # ln_1, ln_2 (weight, bias), attn.c_proj.bias, mlp.c_proj.bias
        return 6 * self.d

    def tp_replicated_root(self):  # wpe, ln_f
        return self.s * self.d + 2 * self.d

    def fwd_flops_per_token(self):
        """Per unit, forward only: 2 x params for the matmuls, + 4 x seq x width for attention."""
        blk = 2 * self.unit + 4 * self.s * self.d
        root = 2 * self.V * self.d  # the tied output head; the embedding lookups are free
        return [root] + [blk] * self.L

    def model_flops_per_token(self):
        return 3 * sum(self.fwd_flops_per_token())  # forward + backward (2x forward)


CALIB_GPT = GPT("bench GPT 49.4M", n_layer=10, d=640, vocab=96, seq=128)
GPT_7B = GPT("7B (GPT-like: 32 x 4096)", n_layer=32, d=4096, vocab=32000, seq=4096)
GPT_70B = GPT("70B (GPT-like: 80 x 8192)", n_layer=80, d=8192, vocab=32000, seq=4096)
GPT_405B = GPT("405B (GPT-like: 126 x 16384)", n_layer=126, d=16384, vocab=32000, seq=4096)

# --------------------------------------------------------------------------------------------------
# Measured on the 2-core machine (docs/benchmarks.md, docs/comm_benchmark.md)

CALIB = {
    "tokens_per_rank": 8 * 128 // 2,  # --global_batch=8 --block_size=128, W=2
    # median step (s) of docs/benchmarks.md, W=2 unless noted
    "steps": {
        "shardtrain_local_compute": 2.583,
        "pytorch_local": 2.588,
        "pytorch_plain (W=1)": 2.472,
        "fsdp_native FULL_SHARD": 2.855,
        "fsdp_native FULL_SHARD over TCP": 2.859,
        "fsdp_native FULL_SHARD fwd_prefetch": 2.698,
        "fsdp_native SHARD_GRAD_OP": 2.705,
        "fsdp (fairscale names, FULL_SHARD)": 2.848,
        "ddp": 2.641,
    },
    "step_spread": 0.08,  # per-round medians spread about +-8% around the median (2.27..2.71 for local)
    "bytes_sent_mib": {"FULL_SHARD": 282.3, "SHARD_GRAD_OP": 188.4, "ddp": 188.4},
    # bench/cluster/results_2026-12-06.jsonl (namespace hosts, 3.2M GPT 4 x 256, block 128, global batch 8, fp32):
    # (shm, TCP) bytes per host and step the communicators counted, the same at 1, 10 and 25 Gbit/s
    "ns_bytes_per_host": {"shardtrain_TP_FSDP": (18886656, 19355672), "shardtrain_HYBRID_SHARD": (38371328, 12867608)},
    "persistent_mib": {1: 753.5, 2: 376.7, 4: 188.4},
    # per-call latency, back-to-back 1-element all-reduces, median (ms)
    "latency_ms": {"shm": 0.039, "tcp": 0.562},
    # docs/comm_benchmark.md, ShardTrain, W=2: (op, dtype, MiB, shm ms, tcp ms)
    "comm": [
        ("all_gather", "float32", 1, 0.22, 0.82), ("all_gather", "float32", 4, 0.53, 3.20),
        ("all_gather", "float32", 16, 3.57, 11.01), ("all_gather", "float32", 64, 15.30, 37.65),
        ("all_gather", "float32", 256, 54.79, 149.33), ("all_gather", "bfloat16", 1, 0.14, 0.94),
        ("all_gather", "bfloat16", 4, 0.55, 2.88), ("all_gather", "bfloat16", 16, 3.79, 11.18),
        ("all_gather", "bfloat16", 64, 14.34, 35.35), ("all_gather", "bfloat16", 256, 56.30, 174.91),
        ("reduce_scatter", "float32", 1, 0.14, 1.05), ("reduce_scatter", "float32", 4, 1.04, 3.20),
        ("reduce_scatter", "float32", 16, 4.43, 11.24), ("reduce_scatter", "float32", 64, 12.05, 45.00),
        ("reduce_scatter", "float32", 256, 43.18, 194.66), ("reduce_scatter", "bfloat16", 1, 0.16, 1.33),
        ("reduce_scatter", "bfloat16", 4, 1.48, 4.21), ("reduce_scatter", "bfloat16", 16, 4.24, 12.92),
        ("reduce_scatter", "bfloat16", 64, 14.81, 53.64), ("reduce_scatter", "bfloat16", 256, 43.12, 209.49),
        ("all_reduce", "float32", 1, 0.23, 1.61), ("all_reduce", "float32", 4, 1.05, 5.69),
        ("all_reduce", "float32", 16, 3.32, 19.96), ("all_reduce", "float32", 64, 17.06, 70.60),
        ("all_reduce", "float32", 256, 60.02, 281.72), ("all_reduce", "bfloat16", 1, 0.24, 1.94),
        ("all_reduce", "bfloat16", 4, 2.17, 5.99), ("all_reduce", "bfloat16", 16, 6.51, 23.25),
        ("all_reduce", "bfloat16", 64, 18.37, 85.12), ("all_reduce", "bfloat16", 256, 79.95, 327.99),
    ],
}

STEP_TOL = 0.10  # calibrated step times must be within 10% of the measured medians
COMM_TOL_LARGE = 0.40  # collectives of >= 16 MiB within 40% of the measured medians

OPS = ("all_gather", "reduce_scatter", "all_reduce")


def ring_factor(op, n):
    return (2.0 if op == "all_reduce" else 1.0) * (n - 1) / n


# --------------------------------------------------------------------------------------------------
# Networks: time of one collective call of `full` bytes (all-gather output, reduce-scatter input,
# all-reduce tensor) over a group


class CalibNet:
    """W=2 on one host: one latency and one bus bandwidth per op (fitted on docs/comm_benchmark.md)."""

    def __init__(self, alpha, busbw):
        self.alpha, self.busbw = alpha, busbw  # s, {op: bytes/s}

    def time(self, op, full, group):
        n = group["n"]
        if n == 1:
            return 0.0
        return self.alpha + ring_factor(op, n) * full / self.busbw[op]


class ClusterNet:
    """Hosts of 8 GPUs; NVLink inside a host, a rail network between hosts; NCCL-like rings.

    A ring of n ranks over h hosts sends (n-1)/n x bytes out of every host (every channel leaves each
    host once), spread over the host's NICs, and (n-1)/n x bytes out of every GPU over NVLink, so its
    bus bandwidth is min(NVLink busbw, host egress available to the group). Groups that run at the
    same time on the same host (HYBRID_SHARD's 8 replicate groups) share the host's egress.
    """

    def __init__(self, name, gpus_per_host, nvl_busbw, nic_eff_per_host, a0, a_nvl, a_net):
        self.name, self.g = name, gpus_per_host
        self.nvl, self.nic_host = nvl_busbw, nic_eff_per_host
        self.a0, self.a_nvl, self.a_net = a0, a_nvl, a_net

    def time(self, op, full, group):
        n, h, conc = group["n"], group["hosts"], group.get("concurrent", 1)
        if n == 1:
            return 0.0
        passes = 2 if op == "all_reduce" else 1
        if h == 1:
            bw = self.nvl
            lat = self.a0 + passes * (n - 1) * self.a_nvl
        else:
            bw = min(self.nvl, self.nic_host / conc)
            lat = self.a0 + passes * ((n - h) * self.a_nvl + (h - 1) * self.a_net)
            if op == "all_reduce":  # a tree (up and down, log2 of the hosts deep) when its latency is lower
                tree = self.a0 + 2 * (math.ceil(math.log2(h)) * self.a_net + (n // h - 1) * self.a_nvl)
                lat = min(lat, tree)
        return lat + ring_factor(op, n) * full / bw


class NamespaceNet:
    """The namespace-host benchmark of issue 11 (not yet run): hosts of 2 ranks on the 2-core machine,
    shared memory inside a host (fitted), Gloo over TCP between hosts through a tc-shaped link of
    `gbit` per host with `delay` per message; the link is shared by the groups that cross it at once."""

    def __init__(self, shm, tcp, gbit, delay=1e-4, eff=0.9):
        self.shm, self.tcp, self.link, self.delay = shm, tcp, gbit / 8 * GB * eff, delay
        self.g = 2

    def time(self, op, full, group):
        n, h, conc = group["n"], group["hosts"], group.get("concurrent", 1)
        if n == 1:
            return 0.0
        if h == 1:
            return self.shm.time(op, full, group)
        passes = 2 if op == "all_reduce" else 1
        bw = min(self.tcp.busbw[op], self.link / conc)
        return self.tcp.alpha + passes * (n - 1) * self.delay + ring_factor(op, n) * full / bw


# --------------------------------------------------------------------------------------------------
# Hardware


class Hardware:
    def __init__(self, name, flops, opt_bytes_per_s, mem_bytes, net):
        self.name, self.flops, self.opt_bw, self.mem, self.net = name, flops, opt_bytes_per_s, mem_bytes, net


H200 = {
    "peak_bf16": 989e12,  # dense bf16 FLOP/s
    "hbm": 141e9,  # bytes per GPU
    "usable": 0.90,  # the rest: CUDA context, NCCL buffers, allocator fragmentation
    "hbm_bw": 4.8e12,  # bytes/s
    "opt_eff": 0.70,  # fraction of HBM bandwidth AdamW reaches
    "gpus_per_host": 8,
    "nvl_busbw": 360e9,  # NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction; 80% of it as busbw
    "nic_gbit": 400,  # one NIC's line rate
    "nic_eff": 0.80,  # fraction of line rate a collective reaches
    "a0": 10e-6,  # per collective call (launch, protocol)
    "a_nvl": 1e-6,  # per ring hop inside a host
    "a_net": 5e-6,  # per ring hop between hosts
}
ADAM_BYTES = 28  # per parameter owned: read master, grad, m, v (16 B), write master, m, v (12 B)


def h200_net(per_gpu_nics):
    nic = H200["nic_gbit"] / 8 * GB * H200["nic_eff"]  # bytes/s one NIC carries in a collective
    host = nic * (H200["gpus_per_host"] if per_gpu_nics else 1)
    name = "400 Gbit/s per GPU (8 NICs per host)" if per_gpu_nics else "400 Gbit/s per host (1 NIC)"
    return ClusterNet(name, H200["gpus_per_host"], H200["nvl_busbw"], host, H200["a0"], H200["a_nvl"], H200["a_net"])


def h200(mfu, per_gpu_nics):
    return Hardware("H200", mfu * H200["peak_bf16"], H200["hbm_bw"] * H200["opt_eff"], H200["hbm"] * H200["usable"],
                    h200_net(per_gpu_nics))


# --------------------------------------------------------------------------------------------------
# Strategies


class Strategy:
    """name; shard group size (None = world); replicate; when the replicate all-reduce runs."""

    def __init__(self, name, kind, shard_group=None, reshard_after_forward=True, replicate_overlapped=False,
                 offered=True, tp=1, sequence_parallel=True):
        self.name, self.kind, self.G = name, kind, shard_group
        self.reshard = reshard_after_forward
        self.rep_overlap = replicate_overlapped
        self.offered = offered
        self.tp = tp  # tensor-parallel size (model_parallel): each layer split over tp GPUs of one host
        self.sp = sequence_parallel  # model_parallel's sequence_parallel option (only read when tp > 1)


FULL_SHARD = Strategy("FULL_SHARD", "fsdp")
SHARD_GRAD_OP = Strategy("SHARD_GRAD_OP", "fsdp", reshard_after_forward=False)
# ShardTrain's HYBRID_SHARD: each unit's replicate all-reduce starts when its reduce-scatter ends (since cdd7f83)
HYBRID = Strategy("HYBRID_SHARD", "fsdp", shard_group=8, replicate_overlapped=True)
# ShardTrain's HYBRID_SHARD before cdd7f83 (every replicate all-reduce issued after backward): --check only
HYBRID_AFTER_BWD = Strategy("HYBRID_SHARD before cdd7f83", "fsdp", shard_group=8, offered=False)
DDP = Strategy("ddp", "ddp")
HYBRID32_OVL = Strategy("HYBRID G=32, overlapped AR*", "fsdp", shard_group=32, replicate_overlapped=True,
                        offered=False)
# model_parallel: tensor parallel (sequence parallel) over the 8 GPUs of a host, FSDP FULL_SHARD over the
# W/8 data-parallel ranks (one per host) of each tensor-parallel position.
TP8 = Strategy("TP8 x FSDP (model_parallel)", "fsdp", tp=8)
# model_parallel as bench/cluster/run.sh runs it: tensor_parallel_size=2 over the 2 ranks of a namespace host
# (shared memory), sequence_parallel off (its default), FSDP FULL_SHARD over the 2 hosts (TCP).
TP2_NS = Strategy("TP2 x FSDP (model_parallel)", "fsdp", tp=2, sequence_parallel=False)
STRATEGIES = [FULL_SHARD, SHARD_GRAD_OP, HYBRID, DDP]
STRATEGIES_70B = [FULL_SHARD, SHARD_GRAD_OP, HYBRID, HYBRID32_OVL, DDP, TP8]
STRATEGIES_405B = [FULL_SHARD, HYBRID32_OVL, TP8]
STRATEGIES_FOR = {GPT_7B.name: STRATEGIES, GPT_70B.name: STRATEGIES_70B, GPT_405B.name: STRATEGIES_405B}


def fsdp_units(model, strat):
    """Parameters of each FSDP unit on one rank before sharding: with tensor parallelism the rank's
    pieces (GPT.tp_units: the split layers' 1/tp plus the parameters every rank of the group keeps whole)."""
    return model.units() if strat.tp == 1 else model.tp_units(strat.tp)


def tp_calls(model, strat, tokens, b_act, dp, ac=False):
    """The tensor-parallel group's collectives of one step, per rank: (forward, backward) per unit as lists
    of (op, bytes of the call), and the calls after backward. The group handles tp x `tokens` (tokens per
    GPU: the same work per GPU as without it); A = that x width activations. Without sequence parallelism
    (tests/tensor_parallel/model_parallel_test.cc, TheoryPerStep) an all-reduce of A after the embedding and
    after each row-wise layer (2 per block) in forward, before the tied head and before each column-wise
    layer in backward, and 3 of the group's tokens (fp32) in the vocabulary-parallel cross-entropy. With it
    each of those all-reduces of A becomes an all-gather and a reduce-scatter of the sequence shards (the
    root: the embedding's reduce-scatter, the head's all-gather, and their mirrors), and after backward the
    partial gradients of the parameters kept whole (ModelParallelStrategy::ReducePartialGradients: one
    all-reduce per parameter of its fp32 data-parallel shard, 1/dp of it on average). Activation checkpointing recomputes the
    blocks' forward, collectives included."""
    n = len(model.units())
    if strat.tp == 1:
        return [[] for _ in range(n)], [[] for _ in range(n)], []
    A = strat.tp * tokens * model.d * b_act
    site = [("all_gather", A), ("reduce_scatter", A)] if strat.sp else [("all_reduce", A)]
    ce = [("all_reduce", strat.tp * tokens * 4)] * 3
    fwd = [site + ce] + [2 * site] * (n - 1)
    bwd = [site] + [(4 if ac else 2) * site] * (n - 1)
    after = []
    if strat.sp:
        d, shard = model.d, 4 / dp  # fp32 bytes of a parameter's data-parallel shard, per element
        after = ([("all_reduce", d * shard)] * (6 * model.L + 2)  # norms, row-wise biases, ln_f
                 + [("all_reduce", model.s * d * shard)])  # wpe
    return fwd, bwd, after


def tp_comm(model, strat, tokens, b_act, net, ac, dp):
    """tp_calls' time: per unit in forward and in backward, and after backward (all on the compute
    stream: nothing overlaps them, as in ShardTrain's model_parallel). Groups inside one host."""
    fwd, bwd, after = tp_calls(model, strat, tokens, b_act, dp, ac)
    group = {"n": strat.tp, "hosts": 1}
    t = lambda calls: sum(net.time(op, size, group) for op, size in calls)
    return [t(c) for c in fwd], [t(c) for c in bwd], t(after)


def tp_bytes_per_rank(model, strat, tokens, b_act, dp):
    """Bytes one rank sends in its tensor-parallel group per step (ring factors, as the communicators count)."""
    fwd, bwd, after = tp_calls(model, strat, tokens, b_act, dp)
    return sum(ring_factor(op, strat.tp) * size for calls in fwd + bwd + [after] for op, size in calls)


def groups(strat, W, gph):
    """(shard group, replicate group) as dicts n / hosts / concurrent."""
    hosts = max(1, W // gph)
    world = {"n": W, "hosts": hosts}
    if strat.kind == "ddp":
        return None, world
    if strat.tp > 1:  # the data-parallel group of a tensor-parallel position: gph/tp ranks per host, the
        # host's tp groups crossing its links at once (tensor-parallel groups inside a host)
        assert gph % strat.tp == 0 and W % strat.tp == 0, (strat.name, W, gph)
        n = W // strat.tp
        h = min(hosts, n)
        return {"n": n, "hosts": h, "concurrent": strat.tp if h > 1 else 1}, None
    G = W if strat.G is None else min(strat.G, W)
    shard = {"n": G, "hosts": max(1, G // gph)}
    R = W // G
    rep = None if R == 1 else {"n": R, "hosts": R, "concurrent": min(G, gph)}
    return shard, rep


def comm_accounting(model, strat, W, gph, b_param, b_grad, tokens=0):
    """Bytes per step: per rank sent in each group (shard, replicate, tensor-parallel), out of each host
    (inter_host_per_host) and, per host, in the groups that stay inside one host (intra_host_per_host: the
    shared memory of the namespace hosts, NVLink on a GPU host; a group that spans hosts counts as
    inter-host only, as ShardTrain's CPU communicators send all of such a group's bytes over TCP). The
    tensor-parallel bytes need `tokens` (per GPU per step) and take the activations at b_param."""
    shard, rep = groups(strat, W, gph)
    units = fsdp_units(model, strat)
    P, root = sum(units), units[0]
    per_host = min(W, gph)
    out = {"shard_rank": 0.0, "rep_rank": 0.0, "tp_rank": 0.0, "inter_host_per_host": 0.0,
           "intra_host_per_host": 0.0}
    if strat.kind == "ddp":
        f = ring_factor("all_reduce", W)
        out["rep_rank"] = f * P * b_grad
        if W > gph:
            out["inter_host_per_host"] = f * P * b_grad  # a ring's egress per host = one rank's share x hosts/hosts
        else:
            out["intra_host_per_host"] = f * P * b_grad * per_host
        return out
    G = shard["n"]
    f = ring_factor("all_gather", G)
    gathered = P + (P - root if strat.reshard else 0)  # forward + backward re-gather (root stays gathered)
    out["shard_rank"] = f * (gathered * b_param + P * b_grad)
    if shard["hosts"] > 1:  # a ring's egress per host, times the groups of a host's ranks (tensor parallel)
        out["inter_host_per_host"] += f * (gathered * b_param + P * b_grad) * shard.get("concurrent", 1)
    else:
        out["intra_host_per_host"] += out["shard_rank"] * per_host
    if rep is not None:
        R = rep["n"]
        per_rank = sum(ring_factor("all_reduce", R) * u / G * b_grad for u in units)
        out["rep_rank"] = per_rank
        out["inter_host_per_host"] += per_rank * min(G, gph)  # the ranks of a host each reduce their shard
    if strat.tp > 1:
        out["tp_rank"] = tp_bytes_per_rank(model, strat, tokens, b_param, G)
        out["intra_host_per_host"] += out["tp_rank"] * per_host
    return out


def memory(model, strat, W, gph, tokens, ac, b_param, b_grad, master=4, adam=8, grad_shard=4):
    """Bytes per rank at the peak (end of forward / during backward). Tensor parallel: the rank's pieces of
    each unit (fsdp_units); with sequence parallelism 1/tp of the tp x tokens of its group's activations (so
    as many as without it per GPU), without it the activations outside the split layers (10 of the 34 B x
    width per token) whole on every rank of the group (Korthikanti et al.: 10 + 24/t)."""
    units = fsdp_units(model, strat)
    P, U, root = sum(units), max(units[1:]), units[0]
    if strat.kind == "ddp":
        state = P * (4 + 4 + adam)  # fp32 parameters (the masters), fp32 gradient buckets, Adam
        transient = b_param * U  # the bf16 copy of the layer computing
    else:
        shard, _ = groups(strat, W, gph)
        G = shard["n"]
        state = P * (master + adam + grad_shard) / G
        # limit_all_gathers=2 (computing + prefetched), the root unit stays gathered, up to 2
        # reduce-scatters in flight + the gradient being written (bf16, full unit)
        gathered = (P if not strat.reshard else 2 * U + root) * b_param
        transient = gathered + 3 * U * b_grad
        if strat.G is not None and W > strat.G:
            transient += P / G * b_grad  # reduce-scatter outputs kept for the replicate all-reduce
    d, L = model.d, model.L
    rf = strat.tp if strat.tp > 1 and not strat.sp else 1  # replicated over the group without sequence parallel
    block_act = tokens * d * (10 * rf + 24)
    if ac:
        act = L * tokens * d * 2 * rf + block_act  # the blocks' inputs + one block recomputed
    else:
        act = L * block_act  # Korthikanti et al. 2022, s*b*h*34 per layer, flash attention
    logits = tokens * model.V * 6  # bf16 logits + fp32 softmax/gradient
    return {"state": state, "transient": transient, "act": act + logits, "total": state + transient + act + logits}


def simulate(model, strat, W, hw, tokens, ac, b_param, b_grad, overlap=True, fwd_prefetch=True):
    """One optimizer step; returns compute, optimizer, step and exposed communication (s)."""
    gph = getattr(hw.net, "g", W)
    shard, rep = groups(strat, W, gph)
    units = fsdp_units(model, strat)
    n = len(units)
    ff = [f * tokens / hw.flops for f in model.fwd_flops_per_token()]
    fb = [2 * x + (x if ac and i > 0 else 0) for i, x in enumerate(ff)]  # recompute blocks, not the head
    net = hw.net
    compute = sum(ff) + sum(fb)
    tpf, tpb, tpa = tp_comm(model, strat, tokens, b_param, net, ac, shard["n"] if shard else 1)  # compute stream
    ff = [a + b for a, b in zip(ff, tpf)]
    fb = [a + b for a, b in zip(fb, tpb)]
    ag = [0.0] * n
    rs = [0.0] * n
    ar = [0.0] * n
    if strat.kind == "ddp":
        bucket = 25 * MiB
        for i, u in enumerate(units):
            calls = max(1, math.ceil(u * b_grad / bucket))
            ar[i] = calls * net.time("all_reduce", u * b_grad / calls, rep)
    else:
        for i, u in enumerate(units):
            ag[i] = net.time("all_gather", u * b_param, shard)
            rs[i] = net.time("reduce_scatter", u * b_grad, shard)
            if rep is not None:
                ar[i] = net.time("all_reduce", u * b_grad / shard["n"], rep)
    P_owned = sum(units) if strat.kind == "ddp" else sum(units) / shard["n"]
    t_opt = P_owned * ADAM_BYTES / hw.opt_bw
    if not overlap:  # 2-core CPU: communication and compute share the same cores
        comm = sum(ag) + sum(rs) + sum(ar) + sum(tpf) + sum(tpb) + tpa
        if strat.kind == "fsdp" and strat.reshard:
            comm += sum(ag[1:])
        step = compute + comm + t_opt
        return {"compute": compute, "opt": t_opt, "step": step, "exposed": comm}
    # forward: [root, b1..bL]; the all-gather of unit i is issued when unit i-1 starts computing
    link = 0.0  # when the shard-group link (or ddp's world link) is free
    t = 0.0
    prev_start = 0.0
    for i in range(n):
        if strat.kind == "fsdp":
            issue = prev_start if fwd_prefetch else t
            start = max(issue, link)
            link = start + ag[i]
            ready = link
        else:
            ready = 0.0
        prev_start = max(t, ready)
        t = prev_start + ff[i]
    # backward: root (head) first, then bL..b1; the root's gradient is reduced last
    order = [0] + list(range(n - 1, 0, -1))
    regather = strat.kind == "fsdp" and strat.reshard
    ag_end = {}
    nic = t  # the replicate group's link
    pending_rs_end = []
    for k, i in enumerate(order):
        start = max(t, ag_end[i]) if (regather and i != 0) else t
        if regather and k + 1 < len(order):  # BACKWARD_PRE: the next unit's gather when this one starts
            s0 = max(start, link)
            link = s0 + ag[order[k + 1]]
            ag_end[order[k + 1]] = link
        t = start + fb[i]
        if i == 0:
            continue  # the root's gradient is complete only at the end (embeddings)
        if strat.kind == "ddp":
            link = max(link, t) + ar[i]
        else:
            link = max(link, t) + rs[i]
            pending_rs_end.append((i, link))
    if strat.kind == "ddp":
        link = max(link, t) + ar[0]
        end = link
    else:
        link = max(link, t) + rs[0]
        pending_rs_end.append((0, link))
        end = link
        if rep is not None:
            if strat.rep_overlap:  # each unit's all-reduce starts when its reduce-scatter ends
                for i, done in pending_rs_end:
                    nic = max(nic, done) + ar[i]
            else:  # ShardTrain's HYBRID_SHARD before cdd7f83: all issued after the last reduce-scatter
                nic = end + sum(ar)
            end = max(end, nic)
    end += tpa  # sequence parallel: the partial gradients' all-reduces, after the reduce-scatters
    step = end + t_opt
    return {"compute": compute, "opt": t_opt, "step": step, "exposed": step - compute - t_opt}


# --------------------------------------------------------------------------------------------------
# Calibration on the 2-core machine


def fit_busbw(rows, op, col, alpha):
    """Least squares on log(time) for one bus bandwidth, latency fixed."""
    pts = [(mib * MiB, r[col]) for r in rows for (o, mib) in [(r[0], r[2])] if o == op]
    f = ring_factor(op, 2)

    def err(bw):
        return sum(math.log((alpha + f * s / bw) / (ms * 1e-3)) ** 2 for s, ms in pts)

    lo, hi = math.log(1e8), math.log(1e11)
    for _ in range(200):  # golden-section search on log(bw)
        a = lo + (hi - lo) * 0.382
        b = lo + (hi - lo) * 0.618
        if err(math.exp(a)) < err(math.exp(b)):
            hi = b
        else:
            lo = a
    return math.exp((lo + hi) / 2)


def calibrate():
    rows = CALIB["comm"]
    nets = {}
    for kind, col in (("shm", 3), ("tcp", 4)):
        alpha = CALIB["latency_ms"][kind] * 1e-3
        nets[kind] = CalibNet(alpha, {op: fit_busbw(rows, op, col, alpha) for op in OPS})
    m = CALIB_GPT
    tok = CALIB["tokens_per_rank"]
    flops = m.model_flops_per_token() * tok
    s = CALIB["steps"]
    # local compute (2 ranks, ~1 core each, half the batch, full AdamW each) vs plain (1 process, 2 cores,
    # the whole batch, one AdamW): t_local = C + O, t_plain = (2C + O) / 2, same implementation (PyTorch)
    O = 2 * (s["pytorch_local"] - s["pytorch_plain (W=1)"])
    C = s["shardtrain_local_compute"] - O
    rate = flops / C
    return nets, rate, O


def calib_hw(nets, rate, O, kind="shm"):
    P = CALIB_GPT.params
    return Hardware("2-core CPU", rate, P * ADAM_BYTES / O, float("inf"), nets[kind])


def calib_rows(nets, rate, O):
    m, tok = CALIB_GPT, CALIB["tokens_per_rank"]
    fp32 = dict(b_param=4, b_grad=4)
    shm, tcp = calib_hw(nets, rate, O, "shm"), calib_hw(nets, rate, O, "tcp")
    local = Hardware("local", rate, shm.opt_bw, shm.mem, CalibNet(0.0, {op: 1.0 for op in OPS}))
    rows = []
    s = CALIB["steps"]

    def add(name, strat, hw, W=2, **kw):
        r = simulate(m, strat, W, hw, tok, False, overlap=False, **fp32, **kw)
        rows.append((name, s[name], r["step"], r["exposed"]))

    # local compute: each rank alone with a full replica = ddp at W=1 (no communication, full AdamW)
    r = simulate(m, DDP, 1, local, tok, False, overlap=False, **fp32)
    rows.append(("shardtrain_local_compute", s["shardtrain_local_compute"], r["step"], 0.0))
    r = simulate(m, DDP, 1, local, 2 * tok, False, overlap=False, **fp32)
    rows.append(("pytorch_plain (W=1)", s["pytorch_plain (W=1)"], r["step"] / 2, 0.0))
    add("fsdp_native FULL_SHARD", FULL_SHARD, shm)
    add("fsdp_native FULL_SHARD over TCP", FULL_SHARD, tcp)
    add("fsdp_native FULL_SHARD fwd_prefetch", FULL_SHARD, shm)
    add("fsdp_native SHARD_GRAD_OP", SHARD_GRAD_OP, shm)
    add("fsdp (fairscale names, FULL_SHARD)", FULL_SHARD, shm)
    add("ddp", DDP, shm)
    return rows


NS_STRATEGIES = [FULL_SHARD, SHARD_GRAD_OP, Strategy("HYBRID_SHARD", "fsdp", shard_group=2, replicate_overlapped=True),
                 DDP, TP2_NS]  # no overlap on 2 cores: the replicate all-reduce's timing does not matter there
NS_IMPL = {"FULL_SHARD": "shardtrain_FULL_SHARD", "SHARD_GRAD_OP": "shardtrain_SHARD_GRAD_OP",
           "HYBRID_SHARD": "shardtrain_HYBRID_SHARD", "ddp": "shardtrain_ddp", TP2_NS.name: "shardtrain_TP_FSDP"}


def namespace_rows(nets, rate, O, gbits=(1, 10, 25)):
    rows = []
    m, tok = CALIB_GPT, 8 * 128 // 4
    for gbit in gbits:
        net = NamespaceNet(nets["shm"], nets["tcp"], gbit)
        hw = Hardware("2 namespace hosts x 2 ranks", rate / 2, m.params * ADAM_BYTES / (2 * O), float("inf"), net)
        row = [f"{gbit} Gbit/s"]
        for st in NS_STRATEGIES:
            r = simulate(m, st, 4, hw, tok, False, b_param=4, b_grad=4, overlap=False)
            acc = comm_accounting(m, st, 4, 2, 4, 4, tokens=tok)
            row.append(f"{r['step']:.2f} ({acc['inter_host_per_host'] / MiB:.0f})")
        rows.append(row)
    return rows


def namespace_check(nets, rate, O, results_path, model, global_batch, delay):
    """Measured (bench/cluster/run.sh's results.jsonl) vs modelled, per link and ShardTrain strategy.
    'calibrated': the 2-core calibration as is (compute rate per rank halved for 4 ranks on 2 cores);
    'anchored': the same plus (measured - modelled) local-compute step of this run, i.e. the compute
    re-measured under this run's load and only the communication modelled."""
    import json
    rows = [json.loads(l) for l in open(results_path) if l.strip()]
    by = {(r["link"], r["impl"]): r for r in rows}
    tok = global_batch * model.s // 4
    local_hw = Hardware("local", rate / 2, CALIB_GPT.params * ADAM_BYTES / (2 * O), float("inf"),
                        CalibNet(0.0, {op: 1.0 for op in OPS}))
    mod_local = simulate(model, DDP, 1, local_hw, tok, False, b_param=4, b_grad=4, overlap=False)["step"]
    meas_local = next(r["median_step_s"] for r in rows if r["impl"] == "shardtrain_local_compute")
    names = NS_IMPL
    tp_rows = []
    out = [["local compute (no comm)", "—", f"{meas_local:.3f}", f"{mod_local:.3f}", pct(mod_local / meas_local - 1),
            f"{meas_local:.3f}", "+0.0%", "0", "—", "—"]]
    for link in sorted({r["link"] for r in rows}, key=lambda l: int(l[:-4])):
        gbit = int(link[:-4])
        net = NamespaceNet(nets["shm"], nets["tcp"], gbit, delay=delay)
        hw = Hardware("2 namespace hosts x 2 ranks", rate / 2, CALIB_GPT.params * ADAM_BYTES / (2 * O), float("inf"), net)
        for st in NS_STRATEGIES:
            r = by.get((link, names[st.name]))
            if not r:
                continue
            sim = simulate(model, st, 4, hw, tok, False, b_param=4, b_grad=4, overlap=False)
            anchored = sim["step"] + meas_local - mod_local
            a = comm_accounting(model, st, 4, 2, 4, 4, tokens=tok)
            acc = a["inter_host_per_host"]
            m = r["median_step_s"]
            out.append([link, st.name, f"{m:.3f}", f"{sim['step']:.3f}", pct(sim["step"] / m - 1), f"{anchored:.3f}",
                        pct(anchored / m - 1), f"{sim['exposed']:.3f}", f"{m - meas_local:+.3f}",
                        f"{acc / MiB:.1f} / {r['wire_bytes_per_host_step'] / MiB:.1f}"])
            if st.tp > 1:  # its groups stay inside a host (tensor parallel) or hold one rank per host (FSDP)
                shm, tcp = r.get("shm_bytes_per_host_step"), r.get("tcp_bytes_per_host_step")
                tp_rows.append([link, st.name, f"{a['intra_host_per_host']:,.0f}", f"{shm:,}",
                                f"{a['intra_host_per_host'] / shm:.6f}", f"{acc:,.0f}", f"{tcp:,}", f"{acc / tcp:.6f}"])
    res = table(["link", "strategy", "measured step (s)", "modelled, calibrated (s)", "error",
                 "modelled, anchored (s)", "error", "modelled comm (s)", "measured exposed (s)",
                 "inter-host MiB/host: modelled / wire"], out)
    if tp_rows:
        res += ("\n\nmodel_parallel, bytes per host and step by link class: modelled (tensor-parallel group = shared "
                "memory, data-parallel group = TCP) vs the communicators' own count\n\n"
                + table(["link", "strategy", "shm modelled (B)", "shm measured (B)", "ratio", "TCP modelled (B)",
                         "TCP measured (B)", "ratio"], tp_rows))
    return res


def comm_rows(nets):
    out = []
    for op, dt, mib, shm_ms, tcp_ms in CALIB["comm"]:
        g = {"n": 2, "hosts": 1}
        out.append((op, dt, mib, shm_ms, nets["shm"].time(op, mib * MiB, g) * 1e3, tcp_ms,
                    nets["tcp"].time(op, mib * MiB, g) * 1e3))
    return out


# --------------------------------------------------------------------------------------------------
# Output


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def pct(x):
    return f"{100 * x:+.1f}%"


def best_config(model, strat, W, hw, tokens, b_param, b_grad):
    """No activation checkpointing when it fits, else checkpointing; None when neither fits."""
    gph = hw.net.g
    for ac in (False, True):
        mem = memory(model, strat, W, gph, tokens, ac, b_param, b_grad)
        if mem["total"] <= hw.mem:
            return ac, mem
    return None, memory(model, strat, W, gph, tokens, True, b_param, b_grad)


WORLDS = [8, 16, 32, 64, 128, 256, 512, 1024]


def predict(model, hw, tokens, strategies):
    bf16 = dict(b_param=2, b_grad=2)
    res = {}
    for W in WORLDS:
        for st in strategies:
            b = dict(b_param=2, b_grad=4) if st.kind == "ddp" else bf16  # ddp reduces fp32 gradients
            ac, mem = best_config(model, st, W, hw, tokens, **b)
            r = None if ac is None else simulate(model, st, W, hw, tokens, ac, **b)
            acc = comm_accounting(model, st, W, hw.net.g, **b)
            res[(W, st.name)] = (ac, mem, r, acc)
    return res


def print_all(args):
    nets, rate, O = calibrate()
    out = []
    P = out.append
    P("## Calibration on the 2-core machine\n")
    P(f"Compute rate {rate / 1e9:.1f} GFLOP/s per rank (model FLOPs, {CALIB_GPT.model_flops_per_token() / 1e6:.1f} "
      f"MFLOP/token x {CALIB['tokens_per_rank']} tokens/rank/step); AdamW step over all "
      f"{CALIB_GPT.params / 1e6:.2f}M parameters {O:.3f} s on one rank's core.\n")
    P(table(["link", "latency (ms, measured)"] + [f"{op} busbw (GB/s, fitted)" for op in OPS],
            [[k, f"{n.alpha * 1e3:.3f}"] + [f"{n.busbw[op] / GB:.2f}" for op in OPS] for k, n in nets.items()]))
    P("\nStep time at W=2 (fp32, 512 tokens per rank): measured median vs modelled (no overlap on 2 cores)\n")
    rows = []
    for name, meas, mod, comm in calib_rows(nets, rate, O):
        tag = " (calibration input)" if name in ("shardtrain_local_compute", "pytorch_plain (W=1)") else ""
        rows.append([name + tag, f"{meas:.3f}", f"{mod:.3f}", pct(mod / meas - 1), f"{comm * 1e3:.0f}",
                     f"{(meas - mod) * 1e3:+.0f}"])
    P(table(["configuration", "measured (s)", "modelled (s)", "error", "modelled comm (ms)",
             "measured - modelled (ms)"], rows))
    P("\nCollectives at W=2 (docs/comm_benchmark.md, ShardTrain): measured vs modelled (ms)\n")
    crow = []
    for op, dt, mib, sm, smod, tm, tmod in comm_rows(nets):
        crow.append([op, dt, mib, f"{sm:.2f}", f"{smod:.2f}", pct(smod / sm - 1), f"{tm:.2f}", f"{tmod:.2f}",
                     pct(tmod / tm - 1)])
    P(table(["op", "dtype", "MiB", "shm meas", "shm model", "error", "TCP meas", "TCP model", "error"], crow))
    m = CALIB_GPT
    P("\nBytes and persistent state (exact accounting, fp32)\n")
    acc = {s.name: comm_accounting(m, s, 2, 2, 4, 4) for s in (FULL_SHARD, SHARD_GRAD_OP, DDP)}
    br = [[k, f"{CALIB['bytes_sent_mib'][k]:.1f}", f"{(v['shard_rank'] + v['rep_rank']) / MiB:.2f}"]
          for k, v in acc.items()]
    P(table(["strategy (W=2)", "measured bytes sent/step/rank (MiB)", "modelled (MiB)"], br))
    P("")
    pr = [[W, f"{meas:.1f}", f"{m.params * 16 / W / MiB:.2f}"] for W, meas in CALIB["persistent_mib"].items()]
    P(table(["W (FULL_SHARD)", "measured persistent state/rank (MiB)", "modelled 16 B x params / W (MiB)"], pr))

    P("\n## Prediction for the namespace-host benchmark at the 49.4M GPT (the 2026-11-30 run used a 3.2M GPT: see --ns-results)\n")
    P("W=4 = 2 hosts x 2 ranks on the 2 cores (compute rate per rank halved), the 49.4M GPT, global batch 8, "
      "fp32, no overlap; shared memory inside a host, TCP through a tc link of 1/10/25 Gbit/s (90% usable) and "
      "0.1 ms per message between hosts. Cell: step s (inter-host MiB per host per step)\n")
    P(table(["link"] + [st.name for st in NS_STRATEGIES], namespace_rows(nets, rate, O)))
    tokens = args.tokens_per_gpu
    for model in (GPT_7B, GPT_70B, GPT_405B):
        P(f"\n## {model.name}: {model.params / 1e9:.2f}B parameters, {model.L} layers, width {model.d}, "
          f"vocab {model.V}, sequence {model.s}, {tokens} tokens per GPU per step, MFU {args.mfu:.2f}\n")
        hwA = h200(args.mfu, True)
        strategies = STRATEGIES_FOR[model.name]
        resA = predict(model, hwA, tokens, strategies)
        P("Memory per GPU (GB; AC = activation checkpointing needed to fit; OOM = does not fit in "
          f"{hwA.mem / GB:.0f} GB)\n")
        mrows = []
        for W in WORLDS:
            row = [W]
            for st in strategies:
                ac, mem, r, _ = resA[(W, st.name)]
                row.append(f"OOM ({mem['total'] / GB:.0f})" if ac is None else
                           f"{mem['total'] / GB:.0f}{' AC' if ac else ''}")
            mrows.append(row)
        P(table(["GPUs"] + [s.name for s in strategies], mrows))
        for per_gpu in (True, False):
            hw = h200(args.mfu, per_gpu)
            res = predict(model, hw, tokens, strategies)
            P(f"\nNetwork between hosts: {hw.net.name}. Cell: step s / tokens/s per GPU / exposed comm % of step "
              f"(inter-host GB per host per step)\n")
            rows = []
            for W in WORLDS:
                row = [W]
                for st in strategies:
                    ac, mem, r, acc = res[(W, st.name)]
                    if r is None:
                        row.append("OOM")
                        continue
                    row.append(f"{r['step']:.2f} / {tokens / r['step']:,.0f} / {100 * r['exposed'] / r['step']:.0f}% "
                               f"({acc['inter_host_per_host'] / GB:.0f})")
                rows.append(row)
            P(table(["GPUs"] + [s.name for s in strategies], rows))
            best = []
            for W in WORLDS:
                cands = [(res[(W, s.name)][2]["step"], s.name) for s in strategies
                         if s.offered and res[(W, s.name)][2] is not None]
                if cands:
                    t, name = min(cands)
                    best.append(f"{W}: {name} ({W * tokens / t:,.0f} tok/s)")
                else:
                    best.append(f"{W}: none fits")
            P("\nFastest offered strategy that fits: " + "; ".join(best))
    P("\n## Sensitivity at 1024 GPUs (tokens per GPU per step, MFU). Cell: step s / exposed comm %\n")
    srows = []
    for model in (GPT_7B, GPT_70B, GPT_405B):
        strategies = STRATEGIES_FOR[model.name]
        for per_gpu in (True, False):
            for tok in (2048, 8192):
                for mfu in (0.40, 0.50):
                    hw = h200(mfu, per_gpu)
                    row = [model.name.split(" ")[0], "per GPU" if per_gpu else "per host", tok, f"{mfu:.2f}"]
                    for st in strategies:
                        b = dict(b_param=2, b_grad=4) if st.kind == "ddp" else dict(b_param=2, b_grad=2)
                        ac, mem = best_config(model, st, 1024, hw, tok, **b)
                        if ac is None:
                            row.append("OOM")
                            continue
                        r = simulate(model, st, 1024, hw, tok, ac, **b)
                        row.append(f"{r['step']:.2f} / {100 * r['exposed'] / r['step']:.0f}%{' AC' if ac else ''}")
                    srows.append(row)
        P(table(["model", "400 Gbit/s", "tokens/GPU", "MFU"] + [st.name for st in strategies], srows))
        P("")
        srows = []
    P("\n* not offered by ShardTrain today: G=32 needs shard groups of 4 hosts (a 2-D mesh); ShardTrain's shard "
      "group is one host. overlapped AR: each unit's replicate all-reduce starts as soon as its reduce-scatter "
      "ends, as in PyTorch HSDP and, since cdd7f83, in ShardTrain's HYBRID_SHARD.")
    print("\n".join(out))


# --------------------------------------------------------------------------------------------------
# --check


def check(args):
    nets, rate, O = calibrate()
    failures = []

    def expect(cond, what):
        print(("ok    " if cond else "FAIL  ") + what)
        if not cond:
            failures.append(what)

    # HYBRID_SHARD inter-host bytes = 2(R-1)/R x params x bytes per element per host and step
    for model in (GPT_7B, GPT_70B):
        for W in WORLDS[1:]:
            R = W // 8
            acc = comm_accounting(model, HYBRID, W, 8, 2, 2)
            theory = 2 * (R - 1) / R * model.params * 2
            expect(abs(acc["inter_host_per_host"] - theory) <= 1e-9 * theory,
                   f"{model.name} W={W}: HYBRID_SHARD inter-host bytes/host {acc['inter_host_per_host']:.4g} "
                   f"= 2(R-1)/R x P x 2 = {theory:.4g}")
            fs = comm_accounting(model, FULL_SHARD, W, 8, 2, 2)["inter_host_per_host"]
            expect(fs > acc["inter_host_per_host"], f"{model.name} W={W}: FULL_SHARD sends more between hosts "
                   f"({fs / GB:.1f} GB/host) than HYBRID_SHARD ({acc['inter_host_per_host'] / GB:.1f})")
    # measured accounting on the 2-core machine
    m = CALIB_GPT
    for st in (FULL_SHARD, SHARD_GRAD_OP, DDP):
        a = comm_accounting(m, st, 2, 2, 4, 4)
        mod = (a["shard_rank"] + a["rep_rank"]) / MiB
        meas = CALIB["bytes_sent_mib"][st.name]
        expect(abs(mod - meas) <= 0.06, f"bytes sent/step/rank {st.name}: modelled {mod:.2f} MiB, measured {meas}")
    for W, meas in CALIB["persistent_mib"].items():
        mod = m.params * 16 / W / MiB
        expect(abs(mod - meas) <= 0.06, f"persistent state W={W}: modelled {mod:.2f} MiB, measured {meas}")
    # calibrated step times
    for name, meas, mod, _ in calib_rows(nets, rate, O):
        expect(abs(mod / meas - 1) <= STEP_TOL, f"step {name}: modelled {mod:.3f} s vs measured {meas:.3f} s "
               f"({pct(mod / meas - 1)}, tolerance {STEP_TOL:.0%})")
    for op, dt, mib, sm, smod, tm, tmod in comm_rows(nets):
        if mib >= 16:
            expect(abs(smod / sm - 1) <= COMM_TOL_LARGE and abs(tmod / tm - 1) <= COMM_TOL_LARGE,
                   f"{op} {dt} {mib} MiB: shm {pct(smod / sm - 1)}, TCP {pct(tmod / tm - 1)} "
                   f"(tolerance {COMM_TOL_LARGE:.0%})")
    # structural invariants on the H200 predictions
    for model in (GPT_7B, GPT_70B):
        for per_gpu in (True, False):
            hw = h200(args.mfu, per_gpu)
            prev = None
            for W in WORLDS:
                for st in STRATEGIES + [HYBRID32_OVL, HYBRID_AFTER_BWD]:
                    b = dict(b_param=2, b_grad=4) if st.kind == "ddp" else dict(b_param=2, b_grad=2)
                    r = simulate(model, st, W, hw, args.tokens_per_gpu, True, **b)
                    if r["exposed"] < -1e-9 or r["step"] < r["compute"] + r["opt"] - 1e-9:
                        expect(False, f"{model.name} {st.name} W={W}: step below compute")
                mem = memory(model, FULL_SHARD, W, 8, args.tokens_per_gpu, True, 2, 2)["total"]
                if prev is not None and mem > prev:
                    expect(False, f"{model.name} W={W}: FULL_SHARD memory grows with W")
                prev = mem
                h1 = memory(model, HYBRID, W, 8, args.tokens_per_gpu, True, 2, 2)["state"]
                h2 = memory(model, HYBRID, 8, 8, args.tokens_per_gpu, True, 2, 2)["state"]
                if abs(h1 - h2) > 1e-6 * h2:
                    expect(False, f"{model.name} W={W}: HYBRID_SHARD sharded state depends on W")
    expect(True, "step >= compute + optimizer, FULL_SHARD memory non-increasing in W, HYBRID state constant in W")
    # HYBRID_SHARD's overlapped replicate all-reduce (since cdd7f83): never slower than issuing them all after
    # backward, the same where nothing crosses hosts (W=8), and faster where the replicate group has work
    for model in (GPT_7B,):
        for per_gpu in (True, False):
            hw = h200(args.mfu, per_gpu)
            for W in WORLDS:
                ovl = simulate(model, HYBRID, W, hw, args.tokens_per_gpu, False, 2, 2)["step"]
                after = simulate(model, HYBRID_AFTER_BWD, W, hw, args.tokens_per_gpu, False, 2, 2)["step"]
                if W == 8:
                    expect(abs(ovl - after) <= 1e-12, f"{model.name} W=8 {hw.net.name}: HYBRID_SHARD step "
                           f"{ovl:.3f} s, no replicate group, the same as before cdd7f83")
                else:
                    expect(ovl < after, f"{model.name} W={W} {hw.net.name}: HYBRID_SHARD step {ovl:.3f} s "
                           f"(overlapped all-reduce) < {after:.3f} s (all after backward, before cdd7f83)")
    # tensor parallel x FSDP: FULL_SHARD's sharded state (16 B x P / W) plus the parameters every rank of a
    # tensor-parallel group keeps whole (norms, row-wise biases, wpe: 7 extra copies of them in 8), gathered
    # units of 1/8 plus those, as many bytes between hosts (within the ring factors), and a step above
    # compute + optimizer
    for model in (GPT_70B, GPT_405B):
        for W in (16, 128, 1024):
            fs = memory(model, FULL_SHARD, W, 8, args.tokens_per_gpu, True, 2, 2)
            tp = memory(model, TP8, W, 8, args.tokens_per_gpu, True, 2, 2)
            whole = model.L * model.tp_replicated_block() + model.tp_replicated_root()
            want = 16 * (model.params + 7 * whole) / W
            expect(abs(tp["state"] - want) <= 1e-9 * want and tp["state"] <= fs["state"] * 1.005,
                   f"{model.name} W={W}: TP8 x FSDP state {tp['state'] / GB:.2f} GB = 16 B x (P + 7 x "
                   f"{whole / 1e6:.1f}M kept whole) / W, FULL_SHARD's {fs['state'] / GB:.2f} GB + "
                   f"{100 * (tp['state'] / fs['state'] - 1):.2f}%")
            expect(fs["transient"] / 8 < tp["transient"] <= fs["transient"] / 8 * 1.1,
                   f"{model.name} W={W}: TP8 x FSDP gathered units {tp['transient'] / GB:.2f} GB, "
                   f"{8 * tp['transient'] / fs['transient']:.3f} x 1/8 of FULL_SHARD's")
            a_fs = comm_accounting(model, FULL_SHARD, W, 8, 2, 2)["inter_host_per_host"]
            a_tp = comm_accounting(model, TP8, W, 8, 2, 2)["inter_host_per_host"]
            expect(a_tp <= a_fs * (1 + 1e-9), f"{model.name} W={W}: TP8 x FSDP inter-host bytes/host "
                   f"{a_tp / GB:.0f} GB <= FULL_SHARD's {a_fs / GB:.0f} GB")
            r = simulate(model, TP8, W, h200(args.mfu, True), args.tokens_per_gpu, True, 2, 2)
            expect(r["exposed"] > 0, f"{model.name} W={W}: TP8 x FSDP's tensor-parallel collectives exposed "
                   f"({100 * r['exposed'] / r['step']:.0f}% of the step)")
    # the tensor-parallel calls = TheoryPerStep of tests/tensor_parallel/model_parallel_test.cc (what that test
    # asserts ShardTrain's communicators send) for its TinyLm (2 layers, width 16, block 8), B = 4 sequences
    # per data-parallel rank: 2x2 without sequence parallelism, 1x4 with it
    tiny = GPT("TinyLm", n_layer=2, d=16, vocab=40, seq=8)
    for dp, sp in ((2, False), (1, True)):
        w, B = 4 // dp, 4
        A, N, L, C = B * tiny.s * tiny.d, B * tiny.s, tiny.L, tiny.d
        ar = lambda floats: 2 * (w - 1) * floats * 4 / w
        if sp:
            theory = 2 * (4 * L + 2) * (w - 1) * (A / w) * 4 + 3 * ar(N) + ar(5 * 2 * C + tiny.s * C + 2 * L * C)
        else:
            theory = (2 + 4 * L) * ar(A) + 3 * ar(N)
        st = Strategy("tp", "fsdp", tp=w, sequence_parallel=sp)
        mod = tp_bytes_per_rank(tiny, st, B * tiny.s // w, 4, dp)
        ncalls = sum(len(c) for part in tp_calls(tiny, st, B * tiny.s // w, 4, dp)[:2] for c in part)
        ncalls += len(tp_calls(tiny, st, B * tiny.s // w, 4, dp)[2])
        want_calls = 2 * (4 * L + 2) + 3 + 5 * 2 + 1 + 2 * L if sp else 5 + 4 * L
        expect(abs(mod - theory) <= 1e-9 * theory and ncalls == want_calls,
               f"TinyLm {dp}x{w}{' sequence parallel' if sp else ''}: tensor-parallel bytes/rank {mod:,.0f} in "
               f"{ncalls} calls = model_parallel_test's TheoryPerStep {theory:,.0f} in {want_calls}")
    # model_parallel on the namespace hosts (tp=2 inside a host, FSDP across): the tensor-parallel bytes
    # through shared memory and the data-parallel bytes over TCP per host = the communicators' count; the
    # same accounting for HYBRID_SHARD (shard group inside a host, replicate group across)
    ns_gpt, ns_tok = GPT("GPT 4x256", n_layer=4, d=256, vocab=96, seq=128), 8 * 128 // 4
    for st in NS_STRATEGIES:
        meas = CALIB["ns_bytes_per_host"].get(NS_IMPL[st.name])
        if meas is None:
            continue
        a = comm_accounting(ns_gpt, st, 4, 2, 4, 4, tokens=ns_tok)
        for key, what, m in (("intra_host_per_host", "shm", meas[0]), ("inter_host_per_host", "TCP", meas[1])):
            expect(abs(a[key] - m) <= 1e-3 * m, f"namespace hosts, 3.2M GPT, {st.name}: {what} bytes/host/step "
                   f"modelled {a[key]:,.0f}, measured {m:,} (ratio {a[key] / m:.6f})")
    # with an infinitely fast network every strategy's step is compute + optimizer
    fast = Hardware("ideal", 445e12, 3.36e12, 1e15, ClusterNet("ideal", 8, 1e30, 1e30, 0, 0, 0))
    for st in STRATEGIES:
        r = simulate(GPT_7B, st, 64, fast, args.tokens_per_gpu, False, 2, 2)
        expect(abs(r["exposed"]) < 1e-9, f"ideal network: {st.name} exposes {r['exposed']:.2e} s")
    print(f"\n{len(failures)} failure(s)")
    return 1 if failures else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="assert invariants and the calibration")
    ap.add_argument("--mfu", type=float, default=0.45, help="achieved / peak bf16 FLOP/s on H200 (default 0.45)")
    ap.add_argument("--tokens-per-gpu", type=int, default=8192, help="tokens per GPU per step (default 8192)")
    ap.add_argument("--ns-results", help="bench/cluster/run.sh's results.jsonl: print measured vs modelled and exit")
    ap.add_argument("--ns-gpt", default="4,256,128,8",
                    help="n_layer,n_embd,block_size,global_batch of that run (default: bench/cluster/run.sh's)")
    ap.add_argument("--ns-delay-ms", type=float, default=0.0,
                    help="per-message delay between hosts in that run (0: tbf only, no netem on this kernel)")
    args = ap.parse_args()
    if args.ns_results:
        L, d, seq, gb = (int(x) for x in args.ns_gpt.split(","))
        nets, rate, O = calibrate()
        print(namespace_check(nets, rate, O, args.ns_results, GPT(f"GPT {L}x{d}", n_layer=L, d=d, vocab=96, seq=seq),
                              gb, args.ns_delay_ms * 1e-3))
        return
    if args.check:
        sys.exit(check(args))
    print_all(args)


if __name__ == "__main__":
    main()
