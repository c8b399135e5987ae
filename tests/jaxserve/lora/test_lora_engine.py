"""LoRA through the whole engine: requests of the base model and of three adapters (two
device slots) batched together each give peft's greedy tokens, all complete, no program is
compiled after warm-up, and the prefix cache is never shared across adapters."""

import pytest
import torch

from jaxserve.engine.config import EngineConfig
from jaxserve.engine.llm import LLM
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.lora import LoRARequest
from jaxserve.lora.peft_adapter import LoRAConfigError
from jaxserve.weights import load_model
from scheduler import SamplingParams
from tests.tiny_lora import ALL_SEVEN, ATTENTION_QV, make_peft_adapter
from tests.tiny_models import make_tiny_model

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# id -> (rank, targets, more LoraConfig fields)
ADAPTERS = {
    1: (4, ATTENTION_QV, {}),
    2: (8, ALL_SEVEN, {"use_rslora": True}),
    3: (2, ["o_proj", "up_proj"], {"layers_to_transform": [1]}),
}
PROMPTS = [[5, 17, 33, 8, 41, 9, 12], [60, 3, 3, 71, 20], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [90, 4]]


def greedy(model, prompt):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    hf_base = make_tiny_model("llama", root / "base")
    loaded = load_model(str(root / "base"), use_cache=False, progress=False)
    requests, want = {}, {None: [greedy(hf_base, p) for p in PROMPTS]}
    for i, (r, targets, extra) in ADAPTERS.items():
        model = make_peft_adapter(hf_base, root / f"adapter{i}", r=r, seed=i, targets=targets, **extra)
        requests[i] = LoRARequest(f"adapter{i}", i, str(root / f"adapter{i}"))
        want[i] = [greedy(model, p) for p in PROMPTS]
    assert all(want[i] != want[None] for i in ADAPTERS), "an adapter that changes no token proves little"
    return root, loaded, requests, want


def engine(loaded, **kw):
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=128, max_model_len=64)
    return LLMEngine(loaded, EngineConfig(**{**cfg, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8, **kw}))


def check_mixed_batch(eng, requests, want):
    """Every prompt with the base model and each adapter, all queued at once: peft's greedy tokens."""
    jobs = [(lora, p) for p in range(len(PROMPTS)) for lora in [None, *ADAPTERS]]
    for n, (lora, p) in enumerate(jobs):
        eng.add_request(str(n), PROMPTS[p], GREEDY, lora_request=requests.get(lora))
    outs = {o.request_id: o.outputs[0].token_ids for o in eng.generate_all()}
    for n, (lora, p) in enumerate(jobs):
        assert list(outs[str(n)]) == want[lora][p], f"prompt {p} with adapter {lora}"


def test_mixed_batch_of_more_adapters_than_slots_gives_peft_s_tokens(tiny):
    _, loaded, requests, want = tiny
    eng = engine(loaded)
    compiles_after_warm_up = eng.compilations
    check_mixed_batch(eng, requests, want)
    assert eng.compilations == compiles_after_warm_up, "a program was compiled after warm-up"
    eng.scheduler.check_integrity()
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.config.num_blocks - 1, "blocks leaked"


def test_the_same_prompt_under_another_adapter_shares_no_cached_kv(tiny):
    """Run in turn, each request could reuse the previous one's blocks if the cache ignored
    the adapter: then adapter 2 would continue from adapter 1's KV and its tokens would differ."""
    _, loaded, requests, want = tiny
    eng = engine(loaded, max_cpu_loras=2)
    prompt = PROMPTS[2]  # 11 tokens: two full blocks
    hits = []
    for n, lora in enumerate([1, 2, None, 1]):
        eng.add_request(str(n), prompt, GREEDY, lora_request=requests.get(lora))
        (out,) = eng.generate_all()
        assert list(out.outputs[0].token_ids) == want[lora][2], f"adapter {lora}"
        hits.append(eng.scheduler.prefix_cache_hits)
    assert hits == [0, 0, 0, 8], "only adapter 1's second request may find (its own) cached blocks"


def test_bad_adapters_and_lora_off_are_refused_when_added(tiny, tmp_path):
    root, loaded, requests, _ = tiny
    eng = engine(loaded, max_lora_rank=4)
    with pytest.raises(LoRAConfigError, match="max_lora_rank"):
        eng.add_request("x", PROMPTS[0], GREEDY, lora_request=requests[2])  # rank 8
    with pytest.raises(LoRAConfigError, match="adapter_config.json"):
        eng.add_request("y", PROMPTS[0], GREEDY, lora_request=LoRARequest("none", 9, str(tmp_path)))
    eng.add_request("ok", PROMPTS[0], GREEDY, lora_request=requests[1])
    with pytest.raises(ValueError, match="already adapter"):  # one id, one adapter
        eng.add_request("z", PROMPTS[0], GREEDY, lora_request=LoRARequest("other", 1, requests[3].lora_path))
    assert list(eng.scheduler.requests) == ["ok"]
    off = LLMEngine(loaded, EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, num_blocks=32, max_model_len=64))
    with pytest.raises(ValueError, match="enable_lora"):
        off.add_request("x", PROMPTS[0], GREEDY, lora_request=requests[1])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    for other in [
        dict(batch_invariant=True),
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
    ]:
        with pytest.raises(ValueError, match="enable_lora does not run with"):
            EngineConfig(enable_lora=True, **other)


def test_llm_generate_takes_one_lora_request_or_one_per_prompt(tiny):
    root, _, requests, want = tiny
    llm = LLM(str(root / "base"), enable_lora=True, max_loras=1, max_lora_rank=8, max_num_seqs=4, max_model_len=64)
    outs = llm.generate(PROMPTS[:2], GREEDY, lora_request=requests[1], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want[1][:2]
    outs = llm.generate(PROMPTS[:3], GREEDY, lora_request=[requests[3], None, requests[2]], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [want[3][0], want[None][1], want[2][2]]


@pytest.mark.parametrize("tp", [2, 4])  # 4 devices over the tiny model's 2 KV heads: K/V (and their B) repeated
def test_tensor_parallel_adapters_give_peft_s_tokens_from_split_stacks(tiny, tp):
    _, loaded, requests, want = tiny
    eng = engine(loaded, tensor_parallel_size=tp)
    check_mixed_batch(eng, requests, want)
    # Split as their projections: B of a column-parallel one on d_out, A of a row-parallel one on d_in.
    stacks = eng.runner.params["layers"][0]["lora"]
    for name, axis in [("q_proj_b", 2), ("k_proj_b", 2), ("up_proj_b", 2), ("o_proj_a", 1), ("down_proj_a", 1)]:
        shard = stacks[name].addressable_shards[0].data.shape
        assert shard[axis] * tp == stacks[name].shape[axis], (name, shard, stacks[name].shape)
    assert stacks["q_proj_a"].addressable_shards[0].data.shape == stacks["q_proj_a"].shape  # whole
