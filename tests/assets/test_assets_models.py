"""The project's own offline models: deterministic files that load in transformers and vLLM alike."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from torchtitan_rl.assets.make_model import MODEL_SIZES, directory_digest, ensure_model, make_model


def test_same_seed_gives_byte_identical_directories(tmp_path):
    a = make_model("tiny", tmp_path / "a", seed=0)
    b = make_model("tiny", tmp_path / "b", seed=0)
    c = make_model("tiny", tmp_path / "c", seed=1)
    assert directory_digest(a) == directory_digest(b)
    assert directory_digest(a) != directory_digest(c)
    names = sorted(p.name for p in a.iterdir())
    for required in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert required in names


def test_ensure_model_remakes_a_cached_model_of_another_shape(tmp_path):
    made = ensure_model("tiny", tmp_path)
    digest = directory_digest(made)
    written_at = (made / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("tiny", tmp_path) == made
    assert (made / "model.safetensors").stat().st_mtime_ns == written_at  # reused, not remade
    config = json.loads((made / "config.json").read_text())
    config["num_attention_heads"] += 1  # as if the size's shape changed since it was cached
    (made / "config.json").write_text(json.dumps(config))
    assert directory_digest(ensure_model("tiny", tmp_path)) == digest
    assert json.loads((made / "config.json").read_text())["num_attention_heads"] == (
        MODEL_SIZES["tiny"].num_attention_heads
    )


def test_make_model_cli_writes_the_requested_size(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_rl.assets.make_model", "--size", "tiny", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == MODEL_SIZES["tiny"].hidden_size
    assert config["model_type"] == "qwen3"


def test_tokenizer_has_chat_template_and_turn_tokens(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Sort: MarcChardin, AnnaBell <alphabetical_sorted> 12 // new name!"}],
        add_generation_prompt=True, tokenize=False,
    )
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level BPE: lossless
    assert tok.eos_token == "<|im_end|>"
    assert tok.convert_tokens_to_ids("<|im_start|>") != tok.unk_token_id


@pytest.mark.slow
def test_transformers_and_vllm_agree_on_greedy_tokens_in_float32(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import EngineArgs, LLMEngine, SamplingParams

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": t}],
                                           add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)
        for t in ("Sort these names: ZoeAdams, MarcChardin", "Now sort ALL of these names")
    ]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(tiny_model_dir), dtype="float32", max_model_len=256, enforce_eager=True,
        enable_chunked_prefill=False, kv_cache_memory_bytes=64 << 20, seed=0,
    ))
    num_new = 8
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids},
                           SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True, logprobs=0))
    vllm_tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                vllm_tokens[out.request_id] = list(out.outputs[0].token_ids)
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=num_new, do_sample=False,
                                 min_new_tokens=num_new)
        assert hf_out[0, len(ids):].tolist() == vllm_tokens[str(i)]


def test_pad_token_row_is_initialised_like_every_other_row(tmp_path):
    """Token 0 (<|endoftext|>, the pad id) once had an all-zero embedding row: a sampled pad token
    fed RMSNorm a zero vector and its gradient exploded. Only that row differs from a model
    built with padding_idx (same seed, same RNG stream)."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    made = make_model("tiny", tmp_path / "m", seed=0)
    config = json.loads((made / "config.json").read_text())
    assert config["pad_token_id"] == 0
    weights = load_file(made / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    row0 = embedding[0]
    assert row0.abs().min() > 0  # no zero entry, let alone a zero row
    others = embedding[1:].norm(dim=1)
    assert others.min() <= row0.norm() <= others.max()
    assert abs(row0.std().item() - config["initializer_range"]) < 0.5 * config["initializer_range"]

    torch.manual_seed(0)  # what the maker built before: padding_idx=0 zeroes row 0
    old = Qwen3ForCausalLM(Qwen3Config.from_pretrained(made)).to(torch.float32).state_dict()
    assert old["model.embed_tokens.weight"][0].abs().sum() == 0
    assert torch.equal(old["model.embed_tokens.weight"][1:], embedding[1:])
    for name, tensor in weights.items():
        if name != "model.embed_tokens.weight":
            assert torch.equal(old[name], tensor), name


def test_ensure_model_remakes_a_model_made_by_an_older_maker(tmp_path):
    from torchtitan_rl.assets.make_model import MAKER_FILE, MAKER_VERSION

    made = ensure_model("tiny", tmp_path)
    digest = directory_digest(made)
    assert json.loads((made / MAKER_FILE).read_text()) == {
        "maker_version": MAKER_VERSION, "size": "tiny", "seed": 0}
    (made / MAKER_FILE).unlink()  # as cached before the maker wrote a version (zero pad row)
    assert directory_digest(ensure_model("tiny", tmp_path)) == digest
    (made / MAKER_FILE).write_text(json.dumps(
        {"maker_version": MAKER_VERSION - 1, "size": "tiny", "seed": 0}))
    assert directory_digest(ensure_model("tiny", tmp_path)) == digest


CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}


def test_chat_template_without_tools_is_plain_chatml(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"}, {"role": "user", "content": "sort"}]
    for generation_prompt in (True, False):
        assert tok.apply_chat_template(conversation, tokenize=False,
                                       add_generation_prompt=generation_prompt) == (
            tok.apply_chat_template(conversation, tokenize=False, chat_template=CHATML,
                                    add_generation_prompt=generation_prompt))


def test_chat_template_renders_tools_calls_and_results_as_qwen3s(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    call = {"id": "c1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 40}'}}
    conversation = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "2 + 40?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},  # a reply that only calls
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"},
        {"role": "assistant", "content": "Adding.", "tool_calls": [
            {"function": {"name": "add", "arguments": {"a": 1, "b": 1}}}]},
    ]
    text = tok.apply_chat_template(conversation, tools=[ADD_TOOL], tokenize=False)
    assert text == (
        "<|im_start|>system\nUse tools.\n\n# Tools\n\nYou may call one or more functions to assist "
        "with the user query.\n\nYou are provided with function signatures within <tools></tools> "
        "XML tags:\n<tools>\n" + json.dumps(ADD_TOOL) + "\n</tools>\n\nFor each function call, "
        "return a json object with function name and arguments within <tool_call></tool_call> XML "
        'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n2 + 40?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\nok\n"
        "</tool_response><|im_end|>\n"
        '<|im_start|>assistant\nAdding.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, '
        '"b": 1}}\n</tool_call><|im_end|>\n')
