"""`jaxserve chat`: talk with a model in the terminal, through the library (an LLMEngine and
the model's chat template).

    jaxserve chat                                         # the embedded default model
    jaxserve chat --model ./Qwen3-0.6B --system "Answer in one sentence." --temperature 0.7
    echo "What is the capital of France?" | jaxserve chat --max-tokens 64

Each reply streams as it is generated, and every turn sends the whole conversation so far.
`/exit` (or ctrl-D) leaves, `/clear` starts the conversation over, ctrl-C stops a reply.
When stdin is not a terminal, all of it is one message: one reply, then exit.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from typing import TextIO

from jaxserve.config_file import add_config_flag, parse_with_config
from jaxserve.flags import HelpFormatter, add_model_flags, model_engine_kwargs, parse_bytes, start_devices
from jaxserve.logs import configure_logging, say_loading

HELP_LINE = "/exit or ctrl-D: leave; /clear: start over; ctrl-C: stop a reply"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jaxserve chat", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", help="Hugging Face folder, .gguf file or hub id (default: the embedded model)")
    p.add_argument("--system", help="a system message that opens the conversation")
    p.add_argument("--chat-template", help="a chat template file, or the template text, instead of the tokenizer's")
    p.add_argument("--max-tokens", type=int, default=512, help="most tokens in one reply")
    p.add_argument("--temperature", type=float, help="0 is greedy (default: the model's generation config, else 1)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int, help="0 is off")
    p.add_argument("--seed", type=int, help="the replies' seeds come from a stream this starts: a rerun says the same")
    p.add_argument("--max-model-len", type=int, help="the conversation's most tokens (default: the model's)")
    p.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default="256MiB", metavar="SIZE", help="the KV cache")
    add_model_flags(p)
    p.add_argument("--cache-dir", help="converted weights and compiled programs (default $JAXSERVE_CACHE)")
    p.add_argument("-v", "--verbose", action="store_true", help="log loading and compilation")
    add_config_flag(p)
    return parse_with_config(p, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    configure_logging("info" if args.verbose else "warning", fmt="%(message)s")
    from jaxserve.weights.hub import check_model_reference

    try:
        if args.nnodes > 1:
            raise ValueError("jaxserve chat runs on one host: for several, serve the model (jaxserve serve)")
        check_model_reference(args.model, args.revision)
        start_devices(args, args.tensor_parallel_size)  # before jax starts
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from jaxserve.engine import LLMEngine
    from jaxserve.engine.tokenization import read_chat_template
    from jaxserve.weights.default_model import DefaultModelMissing
    from jaxserve.weights.hub import resolve_model

    interactive = sys.stdin.isatty()
    try:
        template = read_chat_template(args.chat_template) if args.chat_template else None
        message = None if interactive else read_message(sys.stdin)
        if interactive:  # a pipe's reader wants the reply alone
            say_loading(args.model, args.cache_dir)
        engine = LLMEngine.from_model(
            resolve_model(args.model, args.revision),
            dtype=args.dtype,
            cache_dir=args.cache_dir,
            progress=sys.stderr.isatty(),
            quantization=args.quantization,
            max_num_seqs=1,
            max_model_len=args.max_model_len,
            kv_cache_memory=args.kv_cache_memory_bytes,
            seed=args.seed,
            **model_engine_kwargs(args),
        )
    except (DefaultModelMissing, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    flags = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    params = engine.default_sampling_params(
        max_tokens=args.max_tokens, **{k: v for k, v in flags.items() if v is not None}
    )
    chat = Conversation(engine, params, system=args.system, chat_template=template)
    if not interactive:
        return 0 if chat.turn(message, sys.stdout) is not None else 1
    import readline  # noqa: F401  (line editing and history for input())

    print(HELP_LINE, file=sys.stderr)
    return chat.loop(read_lines(), sys.stdout)


class Conversation:
    """A conversation with an engine: the messages so far, and a reply streamed per turn."""

    def __init__(self, engine, params, *, system: str | None = None, chat_template: str | None = None):
        self.engine, self.params = engine, params
        self.opening = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.opening)
        self.template_kwargs = {"chat_template": chat_template} if chat_template else {}
        self._turns = 0

    def loop(self, lines: Iterable[str], out: TextIO) -> int:
        """Turns until /exit or the end of `lines`."""
        for line in lines:
            text = line.strip()
            if text in ("/exit", "/quit"):
                break
            if text == "/clear":
                self.messages = list(self.opening)
            elif text:
                self.turn(text, out)
        return 0

    def turn(self, text: str, out: TextIO) -> str | None:
        """Send `text` with the conversation so far, stream the reply to `out` and keep both
        in the conversation; None (and a line on stderr) when there is no reply."""
        from jaxserve.engine.tokenization import encode_chat

        messages = [*self.messages, {"role": "user", "content": text}]
        request_id = f"chat-{self._turns}"
        self._turns += 1
        try:
            _, ids = encode_chat(
                self.engine.tokenizer, messages, self.engine.loaded.config.vocab_size, **self.template_kwargs
            )
            self.engine.add_request(request_id, ids, self.params)
        except ValueError as e:  # no chat template, or the conversation outgrew the context: /clear
            print(f"error: {e}", file=sys.stderr)
            return None
        reply = stream(self.engine, request_id, out.write, out.flush)
        print(file=out, flush=True)
        if reply is not None:
            self.messages = [*messages, {"role": "assistant", "content": reply}]
        return reply


def stream(engine, request_id: str, write: Callable[[str], object], flush: Callable[[], object]) -> str | None:
    """Step the engine until the request finishes, writing its text as it comes; its whole
    text, or None when ctrl-C stopped it."""
    try:
        while engine.has_unfinished():
            for out in engine.step():
                write(out.outputs[0].new_text)
                flush()
                if out.finished:
                    return out.outputs[0].text
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        while engine.has_unfinished():  # the step already dispatched
            engine.step()
        write(" [stopped]")
    return None


def read_lines() -> Iterable[str]:
    """The terminal's lines, until ctrl-D (or ctrl-C at the prompt)."""
    while True:
        try:
            yield input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return


def read_message(stdin: TextIO) -> str:
    text = stdin.read().strip()
    if not text:
        raise ValueError("no message on stdin (pipe one in, or run jaxserve chat in a terminal)")
    return text


if __name__ == "__main__":
    sys.exit(main())
