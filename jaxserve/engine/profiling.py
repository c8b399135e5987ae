"""Where a step's time goes: host phases, device idle time, and the device's time by model part.

Host: the engine times each phase of a step (`StepProfiler`, set `engine.profiler`):
schedule, dispatch (pad the batch and enqueue the jitted calls), wait (block for the
step's tokens), update (write them back) and detokenize (text, stops, outputs). A
watcher thread notes when each step's tokens are ready on the device, so the gaps in
which the device had nothing to run (it finished step N before step N+1 was
dispatched) add up to the device-idle fraction.

Device: `device_breakdown` replays one step under `jax.profiler`, reads the per-op
events of XLA's trace, and charges each op to the model part whose `jax.named_scope`
(jaxserve/model/decoder.py) its HLO metadata names: embed, norm, qkv_proj, rope, kv_write,
attention, o_proj, mlp (or a mixture of experts' moe_router and moe_experts), lm_head; the
sampler is its own program.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import queue
import re
import tempfile
import threading
import time

import jax

PARTS = (
    "embed",
    "norm",
    "qkv_proj",
    "rope",
    "kv_write",
    "attention",
    "o_proj",
    "mlp",
    "moe_router",
    "moe_experts",
    "lm_head",
)
HOST_PHASES = ("schedule", "dispatch", "wait", "update", "detokenize")


class StepProfiler:
    """Accumulates host phase times and device-ready times over many steps."""

    def __init__(self):
        self.seconds = collections.Counter()  # phase -> total seconds
        self.steps = 0
        self.dispatched: list[float] = []  # when each step's last jitted call was enqueued
        self.ready: list[float] = []  # when each step's tokens were ready on the device
        self.shapes = collections.Counter()  # (tokens, sequences) -> steps of that shape
        self.examples: dict[tuple[int, int], object] = {}  # (tokens, sequences) -> one such StepBatch
        self._watch: queue.SimpleQueue = queue.SimpleQueue()
        self._watcher = threading.Thread(target=self._watch_ready, name="step-watcher", daemon=True)
        self._watcher.start()

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def dispatched_step(self, batch, token_ids: jax.Array) -> None:
        """`batch` was enqueued; `token_ids` is its sampler output (ready when the step is done)."""
        self.steps += 1
        shape = (batch.num_tokens, batch.num_seqs)
        self.shapes[shape] += 1
        self.examples.setdefault(shape, batch)
        self.dispatched.append(time.perf_counter())
        self._watch.put(token_ids)

    def _watch_ready(self) -> None:
        while True:
            token_ids = self._watch.get()
            token_ids.block_until_ready()
            self.ready.append(time.perf_counter())

    def device_idle(self) -> tuple[float, float]:
        """(idle seconds, span seconds): time between a step's end and the next one's dispatch,
        over the span from the first dispatch to the last step's end."""
        while len(self.ready) < len(self.dispatched):
            time.sleep(0.001)
        idle = sum(max(0.0, d - r) for r, d in zip(self.ready[:-1], self.dispatched[1:]))
        span = self.ready[-1] - self.dispatched[0] if self.dispatched else 0.0
        return idle, span

    def table(self) -> str:
        """Host milliseconds per step by phase, and the device-idle fraction."""
        steps = max(self.steps, 1)
        idle, span = self.device_idle()
        rows = [f"| {'host phase':<12} | {'ms/step':>8} |", f"|{'-' * 14}|{'-' * 10}|"]
        rows += [f"| {p:<12} | {self.seconds[p] * 1e3 / steps:>8.3f} |" for p in HOST_PHASES]
        rows.append(
            f"steps: {self.steps}; device idle between steps: {idle * 1e3 / steps:.3f} ms/step, "
            f"{100 * idle / span if span else 0:.1f}% of {span:.2f} s"
        )
        return "\n".join(rows)


class NullProfiler:
    """The default: no timing at all."""

    def phase(self, name: str):
        return contextlib.nullcontext()

    def dispatched_step(self, batch, token_ids) -> None:
        pass


# -- the device's time by part --------------------------------------------------------------

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$", re.M)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# Ops XLA made itself (a one-row matmul rewritten to a matrix-vector product) carry no
# metadata; their weight operand still names the module.
_WEIGHT_PARTS = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "o_proj": "o_proj",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
    "lm_head": "lm_head",
}
_WEIGHT = re.compile(r"%params\S*?_(" + "|".join(_WEIGHT_PARTS) + r")_")


def op_parts(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the model part its op_name metadata (or its weight operand)
    names; "other" if neither does."""
    parts = {}
    for name, rest in _INSTRUCTION.findall(hlo_text):
        op_name = _OP_NAME.search(rest)
        if op_name:
            scopes = op_name.group(1).split("/")
            parts[name] = next((p for p in reversed(scopes) if p in PARTS), "other")
        elif weight := _WEIGHT.search(rest):
            parts[name] = _WEIGHT_PARTS[weight.group(1)]
        else:
            parts[name] = "other"
    return parts


def exclusive_op_times(trace_dir: str) -> dict[tuple[str, str], float]:
    """(HLO module, op) -> nanoseconds spent in the op itself, ops nested in it on the
    same thread (a while loop's body) taken out."""
    from jax.profiler import ProfileData

    total: dict[tuple[str, str], float] = collections.Counter()
    for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
        for plane in ProfileData.from_file(path).planes:
            for line in plane.lines:
                ops = []
                for ev in line.events:
                    stats = dict(ev.stats)
                    if "hlo_op" in stats:
                        ops.append((ev.start_ns, ev.start_ns + ev.duration_ns, (stats["hlo_module"], stats["hlo_op"])))
                open_ops: list[list] = []  # [end, key, start, nested ns], innermost last

                def close(upto: float) -> None:
                    while open_ops and open_ops[-1][0] <= upto:
                        end, key, start, nested = open_ops.pop()
                        total[key] += end - start - nested
                        if open_ops:
                            open_ops[-1][3] += end - start

                for start, end, key in sorted(ops, key=lambda o: (o[0], -o[1])):
                    close(start)
                    open_ops.append([end, key, start, 0.0])
                close(float("inf"))
    return total


def device_breakdown(runner, batch, repeats: int = 10) -> dict[str, float]:
    """Milliseconds per step by model part (and "sampler", "other") for `batch` on `runner`.

    The step is replayed `repeats` times under the profiler after one warm run; the KV
    cache it writes into is the runner's own, so run it after the real work.
    """
    inputs, pending = runner.pad_inputs(batch, *runner.bucket_for(batch.num_tokens))
    meta = runner._pad_sampling(batch.sampling, runner.rows_for(batch.num_seqs))
    body_args = (runner.params, runner.kv, inputs, pending, runner.last_tokens)
    body_parts = op_parts(runner._body.lower(*body_args).compile().as_text())
    hidden, *_ = jax.eval_shape(runner._body, *body_args)
    head_parts = op_parts(runner._head.lower(runner.params, hidden, meta).compile().as_text())

    def one_step():
        hidden, runner.kv, *_ = runner._body(runner.params, runner.kv, inputs, pending, runner.last_tokens)
        out, *_ = runner._head(runner.params, hidden, meta)
        out.token_ids.block_until_ready()

    one_step()
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(repeats):
            one_step()
        jax.profiler.stop_trace()
        times = exclusive_op_times(trace_dir)
    result = collections.Counter()
    for (module, op), ns in times.items():
        if module.startswith("jit_body"):
            result[body_parts.get(op, "other")] += ns
        elif module.startswith("jit_head"):
            result["lm_head" if head_parts.get(op) == "lm_head" else "sampler"] += ns
    return {part: ns / 1e6 / repeats for part, ns in result.items()}


def breakdown_table(ms: dict[str, float], title: str) -> str:
    total = sum(ms.values()) or 1.0
    rows = [title, f"| {'device part':<12} | {'ms/step':>8} | {'share':>6} |", f"|{'-' * 14}|{'-' * 10}|{'-' * 8}|"]
    for part in (*PARTS, "sampler", "other"):
        if part in ms:
            rows.append(f"| {part:<12} | {ms[part]:>8.3f} | {100 * ms[part] / total:>5.1f}% |")
    rows.append(f"| {'total':<12} | {total:>8.3f} |        |")
    return "\n".join(rows)


def padding(runner, shapes: collections.Counter) -> dict[str, float]:
    """Work padded in over the steps `shapes` counts ((tokens, sequences) -> steps): tokens
    the layers computed per real token, over every step and over pure-decode steps (one
    token per sequence), and rows the head computed per sequence."""
    real, computed = collections.Counter(), collections.Counter()
    for (tokens, seqs), count in shapes.items():
        padded = runner.bucket_for(tokens)[0]
        kinds = ("all", "decode") if tokens == seqs else ("all",)
        for kind in kinds:
            real[kind] += count * tokens
            computed[kind] += count * padded
        real["rows"] += count * seqs
        computed["rows"] += count * runner.rows_for(seqs)
    return {kind: computed[kind] / real[kind] for kind in real}


def device_report(runner, profiler: StepProfiler, top: int = 2) -> str:
    """Padding over the run, then the device's time by part for the `top` commonest
    compiled step shapes (token bucket x row bucket), each replayed from a batch the engine
    really ran."""
    pad = padding(runner, profiler.shapes)
    report = [
        f"padding: the layers computed {pad.get('all', 1):.3f}x the real tokens "
        f"({pad.get('decode', 1):.3f}x in pure-decode steps), the head {pad.get('rows', 1):.3f}x the rows; "
        f"token buckets {runner.buckets}"
    ]
    steps, example = collections.Counter(), {}
    for (tokens, seqs), count in profiler.shapes.items():
        key = (runner.bucket_for(tokens)[0], runner.rows_for(seqs))
        steps[key] += count
        example.setdefault(key, profiler.examples[(tokens, seqs)])
    for (t, r), count in steps.most_common(top):
        batch = example[(t, r)]
        title = (
            f"{count} steps ran in the {t}-token x {r}-row programs; one of them "
            f"({batch.num_tokens} tokens, {batch.num_seqs} sequences), replayed:"
        )
        report.append(breakdown_table(device_breakdown(runner, batch), title))
    return "\n\n".join(report)


__all__ = [
    "NullProfiler",
    "StepProfiler",
    "breakdown_table",
    "device_breakdown",
    "device_report",
    "op_parts",
    "padding",
]
