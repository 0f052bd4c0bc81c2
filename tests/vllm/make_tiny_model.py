"""Write a tiny random-weight Llama that vLLM's CPU build can serve: ``python make_tiny_model.py DIR``.

Run it with ``.venv-vllm/bin/python`` (it needs torch, transformers and tokenizers, which the
project's venv does not have). No model can be downloaded on these machines, so the tests make
one: a byte-level BPE tokenizer trained here on generated text, and a 2-layer Llama with seeded
random weights (hidden 128, 4 heads, 2 KV heads, head_dim 32: the CPU attention backend accepts
head_dim 32, 64, 80, 96, 112, 128, ...). Its output is junk, which is the point for the tests: a
model that cannot repeat a nonce proves that the probes read a real engine's answers.

The result is deterministic for a given recipe and library versions. The directory is rebuilt
only when its ``kvcanary-recipe.json`` differs from :data:`RECIPE`; it is written to a sibling
temporary directory and renamed into place, so an interrupted run never leaves half a model.
"""

from __future__ import annotations

import fcntl
import json
import random
import shutil
import sys
from pathlib import Path

RECIPE = {
    "version": 1,
    "seed": 1234,
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    # Above vLLM's --max-model-len 1024, so that the server, not the config, sets the limit.
    "max_position_embeddings": 2048,
}
STAMP = "kvcanary-recipe.json"
SPECIAL = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
# The chat template marks roles with special tokens and ends each turn with </s> (the EOS).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_WORD_TEXT = (
    "the a tenant cache block prefix token secret canary nonce repeat exactly model server request "
    "answer memory page key value shared isolation leak probe monitor prompt reply number code word "
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar"
)
WORDS = _WORD_TEXT.split()


def _corpus(rng: random.Random, lines: int = 2000) -> list[str]:
    """Return generated training text: words, numbers and hex, as probes send them."""
    out = []
    for _ in range(lines):
        parts = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
        parts.append(str(rng.randint(0, 99999)))
        parts.append(f"{rng.getrandbits(32):08x}")
        rng.shuffle(parts)
        out.append(" ".join(parts).capitalize() + rng.choice([".", "?", "!", ":"]))
    return out


def _tokenizer(seed: int, vocab_size: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(seed)), trainer=trainer)
    # Completions get a BOS like Llama's; chat prompts get theirs from the template instead.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL[3:],
        model_max_length=RECIPE["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(out: Path) -> None:
    """Write the model, tokenizer and generation config into ``out`` (which must not exist)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _tokenizer(RECIPE["seed"], RECIPE["vocab_size"])
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ("<s>", "</s>", "<pad>")}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=RECIPE["hidden_size"],
        intermediate_size=RECIPE["intermediate_size"],
        num_hidden_layers=RECIPE["num_hidden_layers"],
        num_attention_heads=RECIPE["num_attention_heads"],
        num_key_value_heads=RECIPE["num_key_value_heads"],
        head_dim=RECIPE["head_dim"],
        max_position_embeddings=RECIPE["max_position_embeddings"],
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(RECIPE["seed"])
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"]
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)


def ensure_model(out: Path) -> bool:
    """Make the model in ``out`` unless it is there with this recipe; return True when it was built.

    Safe to call from test sessions running side by side: a lock file serializes them.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f"{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = out / STAMP
        if stamp.is_file() and json.loads(stamp.read_text()) == RECIPE:
            return False
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        build(tmp)
        (tmp / STAMP).write_text(json.dumps(RECIPE, indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        return True


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} DIR", file=sys.stderr)
        return 2
    out = Path(argv[1]).resolve()
    built = ensure_model(out)
    print(f"{'built' if built else 'up to date'}: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
