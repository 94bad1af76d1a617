"""One rank of the tensor-parallel test (run by ``mlx.launch --backend ring -n 2``; not a test file).

Usage: shard_worker.py MODEL_DIR OUT_JSON. Each rank loads the model sharded over the ring group and
generates greedily with stock, lily patched after sharding, stock again after unpatch, and lily
patched before sharding; each rank writes its token lists and head counts to OUT_JSON.rank<r>.
"""

import json
import time
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model, sharded_load

import lily_mlx

PROMPT = "Return a new dictionary with the keys of the mapping and values set to"
N_TOKENS = 12  # the CPU ring costs ~30 ms per all-reduce; a few tokens prove the point


def greedy(model, tokenizer):
    prompt = mx.array(tokenizer.encode(PROMPT))
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=N_TOKENS)]


def head_counts(model):
    layers = model.layers
    deltanet = next(l.linear_attn for l in layers if l.is_linear)
    attention = next(l.self_attn for l in layers if not l.is_linear)
    return {"deltanet_v_heads": deltanet.num_v_heads, "deltanet_k_heads": deltanet.num_k_heads,
            "attention_heads": attention.num_attention_heads,
            "attention_kv_heads": attention.num_key_value_heads}


def timed(name, fn, result):
    t0 = time.time()
    out = fn()
    result.setdefault("seconds", {})[name] = round(time.time() - t0, 2)
    return out


def main():
    model_dir, out_path = sys.argv[1], sys.argv[2]
    group = mx.distributed.init(strict=True, backend="ring")
    result = {"size": group.size()}

    model, tokenizer = timed("load", lambda: sharded_load(model_dir, tensor_group=group), result)
    result["heads"] = head_counts(model)
    result["stock"] = timed("stock", lambda: greedy(model, tokenizer), result)
    lily_mlx.patch(model)  # after model.shard()
    result["lily_after_shard"] = greedy(model, tokenizer)
    lily_mlx.unpatch(model)
    result["stock_again"] = greedy(model, tokenizer)

    model2, _ = load_model(Path(model_dir), lazy=True, strict=False)
    lily_mlx.patch(model2)  # before model.shard()
    model2.shard(group)
    mx.eval(model2.parameters())
    result["lily_before_shard"] = greedy(model2, tokenizer)
    result["patched"] = lily_mlx.is_patched(model2)
    result["rank"] = group.rank()
    Path(f"{out_path}.rank{group.rank()}").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
