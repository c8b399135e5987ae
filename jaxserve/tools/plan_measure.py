"""`python -m jaxserve.plan --measure`: the engine's decode step over a batch sweep, timed
on this machine, beside the plan's bound for the same batch and context."""

from __future__ import annotations

import statistics
import time

import numpy as np
from tqdm import tqdm

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.model.sizing import Device, Setup, plan_kv
from jaxserve.weights.load import load_model
from scheduler.sampling_params import SamplingParams


def measure_decode_sweep(args, plan: dict) -> list[dict]:
    """Decode tokens/s at each batch of `args.batches`: `args.measure_steps` engine steps
    of that many sequences, each with a prompt of `args.measure_context` random tokens
    (prefix caching off, so no two share a block), once all their prefills are done.

    Sequences whose prefill ends early decode while the others' run, so when timing starts
    their contexts differ: the bound is taken at their mean context then."""
    batches, context, steps = sorted(args.batches), args.measure_context, args.measure_steps
    st = plan["setup"]
    loaded = load_model(
        args.model, dtype=st["dtype"], quantization=None if args.quantization == "none" else args.quantization
    )
    cfg = loaded.config
    # Each step has room for every decode and one whole prompt, so the last prompt is
    # prefilled within B steps; the first ones decode meanwhile, hence the length.
    budget = batches[-1] + context
    max_len = context + batches[-1] + steps + 4
    kv = plan_kv(
        cfg,
        st["kv_cache_dtype"],
        context=max_len,
        block_size=args.block_size,
        num_blocks=batches[-1] * -(-max_len // args.block_size) + 1,
    )  # the largest batch, whole blocks
    engine = LLMEngine(
        loaded,
        EngineConfig(
            num_blocks=kv.num_blocks,
            max_num_seqs=batches[-1],
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            enable_prefix_caching=False,
        ),
    )
    d = plan["device"]
    device = Device(d["name"], d["memory_bytes"], d["bandwidth_bytes_s"], d["peak_flops"])
    setup = Setup(cfg, st["dtype"], loaded.quantization, st["kv_cache_dtype"])
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=max_len - context, ignore_eos=True, temperature=0.0)
    rows = []
    for batch in tqdm(batches, desc="decode sweep", unit="batch", leave=False):
        for i in range(batch):
            engine.add_request(f"b{batch}-{i}", rng.integers(3, cfg.vocab_size, context).tolist(), params)
        while any(not r.output_token_ids for r in engine.scheduler.requests.values()):
            engine.step()  # the prefills (a request's first token comes with its last chunk)
        running = list(engine.scheduler.requests.values())
        assert len(running) == batch, f"{len(running)} of {batch} sequences still running"
        mean_context = sum(r.num_tokens for r in running) / batch + steps / 2
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        for req in running:
            engine.abort_request(req.request_id)
        engine.generate_all()
        step_s = statistics.median(times)
        bound = setup.decode_bound(device, batch, round(mean_context))
        rows.append(
            {
                "batch": batch,
                "prompt": context,
                "context": round(mean_context),
                "steps": steps,
                "step_ms": step_s * 1e3,
                "tokens_per_s": batch / step_s,
                "bound_tokens_per_s": bound.tokens_per_s,
                "memory_roof_tokens_per_s": batch / bound.memory_s,
                "compute_roof_tokens_per_s": batch / bound.compute_s,
                "ratio": batch / step_s / bound.tokens_per_s,
            }
        )
    return rows
