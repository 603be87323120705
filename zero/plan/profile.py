"""Machine profiles: what one device computes and moves per second, read from and written to yaml.

A profile (``conf/cluster/<name>.yaml``) holds per device: its memory, matmul FLOP/s by shape and
dtype, memory bandwidth, the host link and host optimizer rate (ZeRO-Offload), and for each link
tier (``intra``: inside a node of ``node_size`` devices, ``inter``: across nodes) an α-β cost of
each collective. Time of a collective over n ranks moving S bytes (Hockney's model with the ring
algorithms' step counts, Thakur, Rabenseifner & Gropp 2005):

    all_reduce      2(n-1) α + 2(n-1)/n · S / β        S: the tensor
    reduce_scatter   (n-1) α +  (n-1)/n · S / β        S: the full (unscattered) tensor
    all_gather       (n-1) α +  (n-1)/n · S / β        S: the full (gathered) tensor
    all_to_all       (n-1) α +  (n-1)/n · S / β        S: what one rank sends, its own share included
    p2p                   α +           S / β

so β is the "bus bandwidth" nccl-tests reports and comparable between collectives, and α the
latency of one step. ``fit_alpha_beta`` recovers both from timings by least squares.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p")
TIERS = ("intra", "inter")
DTYPES = ("fp32", "bf16")

# where `load_profile("h100_node")` looks: the repository's conf/cluster (zero/plan -> zero -> repo)
PROFILE_DIR = Path(__file__).resolve().parents[2] / "conf" / "cluster"


def steps(op: str, n: int) -> int:
    """Latency steps of a ring collective over n ranks."""
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1)
    return 1 if op == "p2p" else n - 1


def bus_factor(op: str, n: int) -> float:
    """Bytes over the slowest link per byte of S (see the module docstring)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    return 1.0 if op == "p2p" else (n - 1) / n


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float  # seconds per step
    beta: float  # bytes per second

    def time(self, op: str, nbytes: float, n: int) -> float:
        if n <= 1:
            return 0.0
        return steps(op, n) * self.alpha + bus_factor(op, n) * nbytes / self.beta


def fit_alpha_beta(op: str, n: int, sizes, times) -> AlphaBeta:
    """α and β of ``op`` over ``n`` ranks from timings ``times[i]`` of messages of ``sizes[i]``
    bytes: least squares, in relative error, of t = steps·α + bus_factor·S/β (a line in S). Raises if the timings give a
    non-positive bandwidth (they do not grow with the size: too few or too noisy)."""
    sizes, times = np.asarray(sizes, dtype=np.float64), np.asarray(times, dtype=np.float64)
    if sizes.shape != times.shape or sizes.size < 2 or len(set(sizes.tolist())) < 2:
        raise ValueError(f"fit_alpha_beta needs at least two distinct sizes with one time each, got {sizes.size}")
    x = bus_factor(op, n) * sizes
    A = np.stack([np.full_like(x, steps(op, n)), x], axis=1)
    # relative residuals: the sizes span orders of magnitude, and plain least squares would fit the
    # largest messages only, leaving α to their noise
    w = 1.0 / np.maximum(times, 1e-12)
    (alpha, inv_beta), *_ = np.linalg.lstsq(A * w[:, None], times * w, rcond=None)
    if not inv_beta > 0:
        raise ValueError(
            f"{op} over {n} ranks: the timings {times.tolist()} do not grow with the sizes {sizes.tolist()}, "
            f"so no bandwidth can be fitted; time larger messages or more repeats"
        )
    # a negative intercept is noise around a latency too small to resolve at these sizes
    return AlphaBeta(alpha=max(float(alpha), 0.0), beta=float(1.0 / inv_beta))


@dataclass(frozen=True)
class Profile:
    """One device's rates and its links; every field is per device (see the module docstring)."""

    name: str
    device: str  # what it is, in words
    device_memory_bytes: float
    node_size: int  # devices per node: a group inside one node uses the intra tier
    # matmul FLOP/s by dtype and shape: [[m, k, n, flop_s], ...] ([n, flop_s]: an n x n x n product)
    matmul_flops: dict[str, list[list[float]]]
    memory_bandwidth: float  # bytes/s of a large device copy (read + write counted)
    collectives: dict[str, dict[str, AlphaBeta]]  # tier -> op -> α, β
    host_memory_bytes: float = math.inf  # per node, for ZeRO-Offload's optimizer state
    host_link_bandwidth: float = math.inf  # bytes/s device <-> host, one direction
    host_adam_params_per_s: float = math.inf  # the offloaded optimizer's step rate on the host
    # devices of a node that compute at the same time (a CPU's cores: more ranks than cores share them)
    compute_slots: int | None = None
    op_overhead_s: float = 0.0  # fixed cost of one dispatched operator (launch, dispatch, autograd bookkeeping)
    # the same in the backward, per forward operator over the backward's ~1.7 for each (a forward's
    # operators also run the modules' Python and record the graph); None: op_overhead_s
    backward_op_overhead_s: float | None = None
    # bytes/s of a block's non-matmul operators (each one's inputs read, its output written) beyond
    # their fixed cost: one rate, or [[rows, bytes_s], ...] by the rows of the tensors (a
    # micro-batch's tokens; a CPU's rate falls as they outgrow its caches: 42 GB/s at 256 rows of
    # 64 and 256, 18 at 16,384, experiments.calibrate.measure_elementwise); None: memory_bandwidth
    # (a GPU's elementwise kernels run near it)
    elementwise_bandwidth: float | list[list[float]] | None = None
    # the same of the FFN activation (silu or gelu, the gate's product, their backward): a CPU
    # computes silu's exponential at ~2.7 G values/s on one core whatever their size, a third of
    # what its other operators run at from cache; None: the elementwise rate
    activation_bandwidth: float | list[list[float]] | None = None
    # the same of the forward's other operators as a real block runs them: a reference MoE block's
    # measured forward less its products, attention kernel, activation and operators' fixed cost,
    # per byte its other operators move (experiments.calibrate.measure_forward_elementwise). It
    # takes in what the mixes behind elementwise_bandwidth miss (the router's reductions over rows
    # of a few experts, the expert kernel's bookkeeping per block, strided views): 7-15 GB/s on a
    # 2-core CPU where the mix gives 19-39. None: the elementwise rate
    forward_elementwise_bandwidth: float | list[list[float]] | None = None
    # a split backward's passes (the zero-bubble schedules': torch's stage_backward_input, then
    # stage_backward_weight) each over one whole backward of the same block: one share or
    # [[rows, share], ...] by a micro-batch's tokens (experiments.calibrate.measure_split_backward:
    # on a 2-core CPU the input pass alone takes 0.9-1.0 of the whole and the weight pass 0.6-0.7
    # more, as its graph is walked twice). None: the planner's own split of the whole (sum 1)
    split_input_share: float | list[list[float]] | None = None
    split_weight_share: float | list[list[float]] | None = None
    # other work that shares the node's compute slots, in busy processes (0 on dedicated GPUs; on a
    # shared host measured from the share s of a core one busy process gets: slots / s - 1)
    background_load: float = 0.0
    # the ranks of a node share device_memory_bytes (CPU ranks in one host's memory)
    memory_shared_by_node: bool = False
    # the routed experts' kernel, which decides what they save per row (moe.costs): grouped (GPU) or fused (CPU)
    expert_kernel: str = "grouped"
    # causal attention's kernel (SDPA) by dtype, sequence length L and head dim J:
    # [[L, J, flop_s, backward_ratio], ...], the forward's FLOP/s (scores and values at half,
    # causal, as moe.costs counts them) and the backward's time over the forward's. Without a row
    # for the dtype, attention's products take the matmul rate (and a backward of 2.5 forwards)
    attention_flops: dict[str, list[list[float]]] = field(default_factory=dict)
    # the collective library's own copies (gloo: a reduce-scatter clones its input, an all-gather
    # gathers into a buffer of its own before copying out; NCCL works in place): each such
    # collective in flight holds one more full-size copy of its tensor
    collective_copies: bool = False
    # what an asynchronous collective takes from the computing cores where every core computes (a
    # CPU's gloo ranks) and it runs beside compute (ZeRO-3's prefetched gathers, the reductions
    # launched as the backward goes): per op, the process's CPU seconds per call (its launch,
    # gloo's worker, the system calls that copy its bytes), α per ring step and β, fitted like the
    # collectives' times (experiments.calibrate.measure_collectives); its waits, asleep, take
    # none. An op without one: its bytes alone (the collective's time less its α steps)
    collectives_beside: dict[str, AlphaBeta] = field(default_factory=dict)
    notes: str = ""
    sources: dict[str, str] = field(default_factory=dict)  # field -> where its value comes from

    def __post_init__(self):
        if not isinstance(self.node_size, int) or self.node_size < 1:
            raise ValueError(f"profile {self.name}: node_size={self.node_size!r} must be a positive integer")
        for tier in TIERS:
            missing = [op for op in COLLECTIVES if op not in self.collectives.get(tier, {})]
            if missing:
                raise ValueError(f"profile {self.name}: collectives.{tier} lacks {missing} (needs {list(COLLECTIVES)})")
        odd = sorted(set(self.collectives_beside) - set(COLLECTIVES))
        if odd:
            raise ValueError(f"profile {self.name}: collectives_beside has {odd}; valid ops are {list(COLLECTIVES)}")
        if not self.matmul_flops or any(not rows for rows in self.matmul_flops.values()):
            raise ValueError(f"profile {self.name}: matmul_flops needs [[n, flop_s], ...] for at least one dtype")
        # the points matmul_rate interpolates between, in log space, once (the profile is frozen)
        tables = {}
        for dtype, rows in self.matmul_flops.items():
            pts = []
            for r in rows:
                if len(r) not in (2, 4) or any(v <= 0 for v in r):
                    raise ValueError(
                        f"profile {self.name}: matmul_flops.{dtype} row {r} must be positive [n, flop_s] "
                        f"or [m, k, n, flop_s]"
                    )
                m, k, n = (r[0],) * 3 if len(r) == 2 else r[:3]
                pts.append(((math.log(m), math.log(k), math.log(n)), (math.log(r[-1]),)))
            tables[dtype] = pts
        object.__setattr__(self, "_tables", tables)
        attn = {}
        for dtype, rows in self.attention_flops.items():
            for r in rows:
                if len(r) != 4 or any(not v > 0 for v in r):
                    raise ValueError(
                        f"profile {self.name}: attention_flops.{dtype} row {r} must be positive "
                        f"[L, J, flop_s, backward_ratio]"
                    )
            if rows:
                attn[dtype] = [((math.log(r[0]), math.log(r[1])), (math.log(r[2]), r[3])) for r in rows]
        object.__setattr__(self, "_attn", attn)
        if not self.background_load >= 0:
            raise ValueError(f"profile {self.name}: background_load={self.background_load!r} must be >= 0")
        for key in _RATE_TABLES:
            unit = "a share of the whole backward" if key in _SHARES else "bytes/s"
            object.__setattr__(self, "_" + key, _rate_table(self.name, key, getattr(self, key), unit))
        if (self.split_input_share is None) != (self.split_weight_share is None):
            raise ValueError(
                f"profile {self.name}: split_input_share and split_weight_share come together "
                f"(got {self.split_input_share!r} and {self.split_weight_share!r})"
            )

    def matmul_rate(self, dtype: str, m: float, k: float, n: float) -> float:
        """FLOP/s of an [m, k] @ [k, n] product: the measured shapes' rates, interpolated in log
        space (inverse-distance weights, power 4: the nearest shapes dominate; a measured shape
        gives its own rate; one shape gives its rate everywhere). A dtype the profile lacks takes
        the first one it has."""
        pts = self._tables.get(dtype) or next(iter(self._tables.values()))
        return math.exp(_interpolate(pts, (m, k, n))[0])

    def attention_rate(self, dtype: str, L: float, J: float) -> tuple[float, float] | None:
        """(FLOP/s of causal attention's forward, its backward's time over the forward's) at
        sequence length ``L`` and head dim ``J``, interpolated as ``matmul_rate`` does; None when
        the profile measured no attention (a dtype it lacks takes the first one it has)."""
        pts = self._attn.get(dtype) or next(iter(self._attn.values()), None)
        if pts is None:
            return None
        log_rate, ratio = _interpolate(pts, (L, J))
        return math.exp(log_rate), ratio

    def link(self, tier: str, op: str) -> AlphaBeta:
        return self.collectives[tier][op]

    def elementwise_rate(self, rows: float) -> float:
        """Bytes/s of the non-matmul operators on tensors of ``rows`` rows: ``elementwise_bandwidth``
        (a table's rates interpolated linearly in log rows and log rate, its ends held beyond
        them), else ``memory_bandwidth``."""
        return _rate_at(self._elementwise_bandwidth, rows, self.memory_bandwidth)

    def activation_rate(self, rows: float) -> float:
        """Bytes/s of the FFN activation's operators on tensors of ``rows`` rows
        (``activation_bandwidth`` as ``elementwise_rate`` reads its table), else the elementwise rate."""
        return _rate_at(self._activation_bandwidth, rows, self.elementwise_rate(rows))

    def forward_elementwise_rate(self, rows: float) -> float:
        """Bytes/s of the forward's non-matmul operators other than the activation on tensors of
        ``rows`` rows (``forward_elementwise_bandwidth`` as ``elementwise_rate`` reads its table),
        else the elementwise rate."""
        return _rate_at(self._forward_elementwise_bandwidth, rows, self.elementwise_rate(rows))

    def split_backward_shares(self, rows: float) -> tuple[float, float] | None:
        """(input pass, weight pass) of a split backward on tensors of ``rows`` rows, each over
        one whole backward (the tables read as ``elementwise_rate`` reads its own); None where the
        profile measured none."""
        if self._split_input_share is None:
            return None
        return _rate_at(self._split_input_share, rows, 1.0), _rate_at(self._split_weight_share, rows, 1.0)

    @property
    def backward_op_s(self) -> float:
        """A backward operator's fixed cost (``backward_op_overhead_s``, else ``op_overhead_s``)."""
        return self.op_overhead_s if self.backward_op_overhead_s is None else self.backward_op_overhead_s

    @property
    def slots(self) -> int:
        return self.node_size if self.compute_slots is None else self.compute_slots

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["collectives"] = {
            t: {op: {"alpha": ab.alpha, "beta": ab.beta} for op, ab in ops.items()}
            for t, ops in self.collectives.items()
        }
        out["collectives_beside"] = {
            op: {"alpha": ab.alpha, "beta": ab.beta} for op, ab in self.collectives_beside.items()
        }
        for key in ("host_memory_bytes", "host_link_bandwidth", "host_adam_params_per_s"):
            if math.isinf(out[key]):
                out[key] = None
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown profile keys {unknown}; valid keys are {sorted(names)}")
        d = dict(d)
        d["collectives"] = {
            t: {op: AlphaBeta(float(v["alpha"]), float(v["beta"])) for op, v in ops.items()}
            for t, ops in (d.get("collectives") or {}).items()
        }
        d["collectives_beside"] = {
            op: AlphaBeta(float(v["alpha"]), float(v["beta"])) for op, v in (d.get("collectives_beside") or {}).items()
        }
        for key in ("host_memory_bytes", "host_link_bandwidth", "host_adam_params_per_s"):
            if d.get(key) is None:
                d.pop(key, None)
            else:
                d[key] = float(d[key])
        for key in ("device_memory_bytes", "memory_bandwidth", "op_overhead_s", "background_load"):
            if key in d:
                d[key] = float(d[key])
        if d.get("backward_op_overhead_s") is not None:
            d["backward_op_overhead_s"] = float(d["backward_op_overhead_s"])
        for key in _RATE_TABLES:
            ew = d.get(key)
            if isinstance(ew, (list, tuple)):
                d[key] = [[float(x) for x in row] for row in ew]
            elif ew is not None:
                d[key] = float(ew)
        for key in ("matmul_flops", "attention_flops"):
            d[key] = {k: [[float(x) for x in row] for row in v] for k, v in (d.get(key) or {}).items()}
        return cls(**d)


# the rates (and the split backward's shares) a profile gives as one number or a table by rows
_SHARES = ("split_input_share", "split_weight_share")
_RATE_TABLES = ("elementwise_bandwidth", "activation_bandwidth", "forward_elementwise_bandwidth", *_SHARES)


def _rate_table(name: str, key: str, value, unit: str = "bytes/s"):
    """A rate field as ``_rate_at`` reads it: None, one rate, or ``[(log rows, log rate), ...]``
    sorted by rows; raises naming the field when it is neither."""
    if value is None:
        return None
    if isinstance(value, list):
        if not value or any(len(r) != 2 or not (r[0] >= 1 and r[1] > 0) for r in value):
            raise ValueError(
                f"profile {name}: {key}={value!r} is invalid: expected one value > 0 ({unit}) or a non-empty "
                "list of [rows >= 1, value > 0]"
            )
        return sorted((math.log(r[0]), math.log(r[1])) for r in value)
    if not value > 0:
        raise ValueError(f"profile {name}: {key}={value!r} must be > 0 ({unit})")
    return float(value)


def _rate_at(table, rows: float, default: float) -> float:
    """The rate of ``table`` (``_rate_table``'s) at ``rows``: linear in log rows and log rate
    between its points, its ends beyond them; ``default`` without one."""
    if table is None:
        return default
    if not isinstance(table, list):
        return table
    x = math.log(max(rows, 1.0))
    if x <= table[0][0]:
        return math.exp(table[0][1])
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x <= x1:
            return math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1)
    return math.exp(table[-1][1])


def _interpolate(pts, at) -> tuple:
    """The values at ``at`` of a table ``[(log point, values), ...]``: inverse-distance weights in
    log space, power 4 (the nearest points dominate); a measured point gives its own values, one
    point its values everywhere."""
    if len(pts) == 1:
        return pts[0][1]
    x = [math.log(max(v, 1.0)) for v in at]
    num, den = [0.0] * len(pts[0][1]), 0.0
    for p, y in pts:
        d2 = sum((a - b) ** 2 for a, b in zip(x, p))
        if d2 < 1e-18:
            return y
        w = 1.0 / (d2 * d2)
        num = [acc + w * v for acc, v in zip(num, y)]
        den += w
    return tuple(v / den for v in num)


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (``h100_node``: ``conf/cluster/h100_node.yaml``) or a yaml file by path."""
    import yaml

    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ValueError(
            f"plan.cluster={name_or_path!r}: no profile {path}; valid names are {available_profiles()} "
            f"(or a path to a profile yaml; `python -m experiments.plan --calibrate --out FILE` writes one)"
        )
    # libyaml's loader where PyYAML was built with it (6x faster on a calibrated profile; the same data)
    data = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a profile: expected a mapping of keys, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    return Profile.from_dict(data)


def save_profile(profile: Profile, path: str | Path, header: str = "") -> Path:
    """Write ``profile`` as yaml (``load_profile`` reads it back equal); ``header``: comment lines on top."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def short_lists(dumper, data):  # a shape row or a list of numbers on one line; mappings in blocks
        flow = all(not isinstance(x, (list, dict)) for x in data)
        return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)

    Dumper.add_representer(list, short_lists)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.dump(profile.to_dict(), Dumper=Dumper, sort_keys=False, default_flow_style=False, width=120)
    lines = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    path.write_text(lines + text)
    return path
