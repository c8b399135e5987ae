"""llama.cpp's side of benchmarks/quantized_decode.py, run by the Python of the venv that
benchmarks/install_llama_cpp.sh makes (llama-cpp-python; nothing of jaxserve is imported).

    .venv-llama-cpp/bin/python benchmarks/llama_cpp_runner.py MODEL.gguf --max-batch 32 --max-context 200

It loads the GGUF once (its blocks as stored: Q4_1, Q8_0, ...) into a context of
`--max-batch` sequences, prints one JSON line ({"ready": true, "version": ...}), then answers
each request line {"batch": B, "context": C, "steps": S, "seed": K} with one line
{"step_s": ..., "cpu_s": ...}: B sequences of C random prompt tokens are prefilled, one
decode step settles, then S decode steps are timed, each a `llama_decode` of B tokens (one
per sequence) and the greedy pick of each sequence's next token; the medians of their wall
and CPU seconds (this process, all threads). The cache is cleared after each request.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import llama_cpp as L
import numpy as np


class Decoder:
    def __init__(self, path: str, max_batch: int, max_context: int, threads: int):
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        params = L.llama_context_default_params()
        params.n_seq_max = max_batch
        params.n_ctx = max_batch * max_context
        params.n_batch = params.n_ubatch = max(max_context, max_batch)
        params.n_threads = params.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit("llama.cpp could not make a context")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(params.n_batch, 0, max_batch)

    def _decode(self, tokens: list[tuple[int, int, int]]) -> list[int]:
        """(token, position, sequence) each, all with logits: the greedy next token of each."""
        b = self.batch
        b.n_tokens = len(tokens)
        for i, (token, pos, seq) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, True
            b.seq_id[i][0] = seq
        if L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        picks = []
        for i in range(len(tokens)):
            row = ctypes.cast(L.llama_get_logits_ith(self.ctx, i), ctypes.POINTER(ctypes.c_float))
            picks.append(int(np.ctypeslib.as_array(row, (self.vocab,)).argmax()))
        return picks

    def run(self, batch: int, context: int, steps: int, seed: int) -> dict:
        rng = np.random.default_rng(seed)
        last = []
        for seq in range(batch):  # a prefill per sequence, logits for its last token only
            prompt = rng.integers(3, self.vocab, context).tolist()
            b = self.batch
            b.n_tokens = context
            for i, token in enumerate(prompt):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, i, 1, i == context - 1
                b.seq_id[i][0] = seq
            if L.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed (prefill)")
            row = ctypes.cast(L.llama_get_logits_ith(self.ctx, -1), ctypes.POINTER(ctypes.c_float))
            last.append(int(np.ctypeslib.as_array(row, (self.vocab,)).argmax()))
        pos = context
        last = self._decode([(t, pos, s) for s, t in enumerate(last)])  # settles, as jaxserve's first step
        walls, cpus = [], []
        for _ in range(steps):
            pos += 1
            wall, cpu = time.perf_counter(), time.process_time()
            last = self._decode([(t, pos, s) for s, t in enumerate(last)])
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        return {"step_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-context", type=int, default=256, help="prompt plus decoded tokens per sequence, at most")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    decoder = Decoder(args.model, args.max_batch, args.max_context, args.threads)
    print(json.dumps({"ready": True, "version": L.__version__, "threads": args.threads}), flush=True)
    for line in sys.stdin:
        r = json.loads(line)
        print(json.dumps(decoder.run(r["batch"], r["context"], r["steps"], r["seed"])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
