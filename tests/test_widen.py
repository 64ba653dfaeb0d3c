"""app/engine/widen.py: stories260K copied into larger shapes decodes exactly like itself."""

import dataclasses
import json

import pytest

from app import LLM, SamplingParams
from app.engine.loader import load_model
from app.engine.models.config import ModelConfig
from app.engine.widen import copy_widened, head_dims, layer_map, widen_config
from tests.conftest import STORIES_GREEDY

# head_dim 8 -> 32 (r = 4), 64 -> 256 hidden (RMSNorm x 1/2), GQA 2 -> 4, 5 layers spread over 8
BIG = ModelConfig(vocab_size=1, hidden_size=256, intermediate_size=384, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=32)
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a big bear"]


def _widened_llm(stories_paths, tmp_path, **kw):
    model_path, tokenizer = stories_paths
    small, small_config = load_model(model_path)
    config = widen_config(small_config, BIG)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    llm = LLM(model=str(tmp_path), load_format="dummy", tokenizer=tokenizer, **kw)
    copy_widened(small, llm.engine.model)
    return llm


def test_widened_model_decodes_like_the_small_one(stories_paths, tmp_path):
    model_path, tokenizer = stories_paths
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small = [o.token_ids for o in LLM(model=model_path, tokenizer=tokenizer).generate(PROMPTS, params)]
    llm = _widened_llm(stories_paths, tmp_path)
    assert llm.engine.model.config.hidden_size == 256 and llm.engine.model.config.num_key_value_heads == 4
    outputs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == small
    assert "Once upon a time" + outputs[0].text[: len(STORIES_GREEDY) - 16] == STORIES_GREEDY


def test_widened_layers_and_heads_are_where_the_docstring_says(stories_paths, tmp_path):
    llm = _widened_llm(stories_paths, tmp_path)
    layers = llm.engine.model.model.layers
    held = layer_map(5, 8)
    assert held == [0, 1, 3, 4, 6]
    for i, layer in enumerate(layers):
        assert (layer.self_attn.o_proj.weight.abs().sum() > 0) == (i in held)
    # small q head 3 (KV head 1, second of its pair) is big head 1 * 4 + 1 = 5, at dims i * 4 per half
    q = layers[0].self_attn.q_proj.weight.view(16, 32, 256)
    used = head_dims(8, 32)
    assert used.tolist() == [0, 4, 8, 12, 16, 20, 24, 28]
    assert q[5][used].abs().sum() > 0 and q[5].abs().sum() == q[5][used].abs().sum()
    assert q[2].abs().sum() == 0  # heads 2, 3 of each KV group carry nothing


def test_widen_config_rejects_shapes_that_cannot_hold_the_model(stories_paths):
    small = load_model(stories_paths[0])[1]
    with pytest.raises(ValueError, match="hidden_size 32 < 64"):
        widen_config(small, dataclasses.replace(BIG, hidden_size=32))
    with pytest.raises(ValueError, match="head_dim 12 is not a multiple of 8"):
        widen_config(small, dataclasses.replace(BIG, head_dim=12))
    with pytest.raises(ValueError, match="1 query heads per KV head < 2"):
        widen_config(small, dataclasses.replace(BIG, num_attention_heads=4))
    with pytest.raises(ValueError, match="built from widen_config"):
        copy_widened(load_model(stories_paths[0])[0], load_model("tiny-llama")[0])


def test_widened_model_with_fp4_kv_tells_the_known_story(stories_paths, tmp_path):
    """The fp4 cache on the widened model still tells the known story (torch path on CPU)."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    out = _widened_llm(stories_paths, tmp_path, kv_cache_dtype="fp4").generate(PROMPTS[:1], params)
    assert ("Once upon a time" + out[0].text).startswith(STORIES_GREEDY[:60])
