"""Single-stream latency of the default model: jaxserve against Hugging Face transformers.

Both run SmolLM2-135M-Instruct from the same GGUF file in float32 on the CPU, one
request at a time, in the same run. Reported:

- time to first token and decode tokens/s, in one process, the two engines taking
  turns prompt by prompt (the median over several rounds, after a warm-up round);
- cold start, from process start to the first generated token on stdout: a first start
  (jaxserve converts the GGUF and compiles; transformers dequantizes the GGUF) and a
  second start (jaxserve restores its orbax weights and compiled programs;
  transformers loads a safetensors copy saved by the first start).

    python benchmarks/single_stream.py [--max-tokens 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "Write a short story about a robot learning to paint.",
    "def quicksort(arr):",
]
ROOT = Path(__file__).resolve().parents[1]


def jaxserve_runner(max_tokens: int, cache_dir: str):
    """A function that generates one prompt and returns (ttft seconds, decode tokens/s)."""
    from jaxserve.engine import EngineConfig, LLMEngine
    from jaxserve.weights import load_model
    from scheduler import SamplingParams

    loaded = load_model(None, cache_dir=cache_dir, progress=False)
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, token_buckets=(8, 16, 64),
                                            max_model_len=256, kv_cache_memory=64 << 20))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run(prompt: str) -> tuple[float, float]:
        engine.add_request("r", prompt, params)
        (out,) = engine.generate_all()
        m = out.metrics
        return m.time_to_first_token, (max_tokens - 1) / (m.last_token_time - m.first_token_time)

    return run


def transformers_runner(max_tokens: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    from jaxserve.default_model import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def run(prompt: str) -> tuple[float, float]:
        ids = tok(prompt, return_tensors="pt").input_ids
        clock = Clock()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, streamer=clock)
        first, last = clock.times[1], clock.times[-1]  # times[0] is the prompt itself
        return first - start, (max_tokens - 1) / (last - first)

    return run


def in_process(max_tokens: int, cache_dir: str, rounds: int) -> tuple[dict, dict]:
    """Both engines, one prompt at a time, alternating (this machine's speed drifts; both
    see the same drift). The first round warms caches and is not counted."""
    runners = {"jaxserve": jaxserve_runner(max_tokens, cache_dir), "transformers": transformers_runner(max_tokens)}
    samples = {name: [] for name in runners}
    for r in range(rounds + 1):
        for prompt in PROMPTS:
            for name, run in runners.items():
                result = run(prompt)
                if r:
                    samples[name].append(result)
    return tuple({"ttft_ms": 1000 * statistics.median(t for t, _ in samples[name]),
                  "decode_tok_s": statistics.median(d for _, d in samples[name])} for name in runners)


HF_COLD_START = """
import sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer
folder, gguf, save = sys.argv[1], sys.argv[2] or None, sys.argv[3] or None
tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
ids = tok(sys.argv[4], return_tensors="pt").input_ids
with torch.inference_mode():
    model.generate(ids, max_new_tokens=4, do_sample=False, streamer=TextStreamer(tok, skip_prompt=True))
if save:  # a plain float32 safetensors copy (transformers will not save a GGUF-loaded model)
    import json, os
    from safetensors.torch import save_file
    os.makedirs(save, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, os.path.join(save, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict(); config.pop("quantization_config", None)
    json.dump(config, open(os.path.join(save, "config.json"), "w"))
    tok.save_pretrained(save)
"""


def first_output_seconds(cmd: list[str]) -> float:
    """Seconds from spawning `cmd` to its first byte on stdout (then let it finish)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    first = proc.stdout.read(1)
    elapsed = time.perf_counter() - start
    proc.communicate()
    if not first or proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed (exit {proc.returncode})")
    return elapsed


def cold_starts(work: Path) -> dict:
    from jaxserve.default_model import default_model_path

    path = default_model_path()
    prompt = PROMPTS[0]
    ours = [sys.executable, "-m", "jaxserve.generate", prompt, "--max-tokens", "4", "--cache-dir", str(work / "jx")]
    saved = work / "hf"
    hf = [sys.executable, "-c", HF_COLD_START]
    return {
        "jaxserve_first_s": first_output_seconds(ours),
        "jaxserve_second_s": first_output_seconds(ours),
        "transformers_first_s": first_output_seconds(hf + [str(path.parent), path.name, str(saved), prompt]),
        "transformers_second_s": first_output_seconds(hf + [str(saved), "", "", prompt]),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5, help="measured rounds over the prompts")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        cold = cold_starts(work)
        ours, theirs = in_process(args.max_tokens, str(work / "jx"), args.rounds)
    result = {"max_tokens": args.max_tokens, "prompts": len(PROMPTS), "jaxserve": ours, "transformers": theirs,
              "cold_start": cold}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    rows = [
        ("time to first token (ms)", ours["ttft_ms"], theirs["ttft_ms"], theirs["ttft_ms"] / ours["ttft_ms"]),
        ("decode (tokens/s)", ours["decode_tok_s"], theirs["decode_tok_s"], ours["decode_tok_s"] / theirs["decode_tok_s"]),
        ("cold start, first (s)", cold["jaxserve_first_s"], cold["transformers_first_s"],
         cold["transformers_first_s"] / cold["jaxserve_first_s"]),
        ("cold start, second (s)", cold["jaxserve_second_s"], cold["transformers_second_s"],
         cold["transformers_second_s"] / cold["jaxserve_second_s"]),
    ]
    print(f"SmolLM2-135M-Instruct, float32, CPU, {args.max_tokens} tokens; median of {args.rounds} rounds "
          f"x {len(PROMPTS)} prompts, the two engines alternating")
    print(f"| {'metric':<26} | {'jaxserve':>9} | {'transformers':>12} | {'speed-up':>8} |")
    print(f"|{'-' * 28}|{'-' * 11}|{'-' * 14}|{'-' * 10}|")
    for name, a, b, ratio in rows:
        print(f"| {name:<26} | {a:>9.1f} | {b:>12.1f} | {ratio:>7.2f}x |")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
