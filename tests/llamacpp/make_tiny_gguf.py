"""Write a tiny random-weight llama GGUF that llama.cpp can serve: ``python make_tiny_gguf.py OUT.gguf``.

Run it with the llama.cpp venv's python (``scripts/setup-llamacpp.sh`` installs ``gguf`` and
``numpy`` there; the project's venv has neither). No model can be downloaded on these machines, so
the tests make one, in well under a second: F32 weights drawn from a seeded generator, n_embd 64,
4 query heads and 2 KV heads of 16 dimensions, 2 layers, feed-forward 128, and a SentencePiece-style
vocabulary (``tokenizer.ggml.model = "llama"``): ``<unk>``, ``<s>``, ``</s>``, the 256 ``<0xNN>``
byte tokens that any text falls back to, then single characters and word pieces. Its output is
junk, which is the point: a model that cannot repeat a nonce proves that a probe read the engine.

The file is deterministic for a given :data:`RECIPE` and ``gguf`` version. It is written next to
``OUT.gguf`` under a temporary name and renamed into place, so a reader never sees half a model.
"""

from __future__ import annotations

import os
import string
import sys
from pathlib import Path

import gguf
import numpy as np

RECIPE = {
    "seed": 1234,
    "n_embd": 64,
    "n_head": 4,
    "n_head_kv": 2,
    "n_layer": 2,
    "n_ff": 128,
    # Above any --n_ctx the tests ask for, so that the server's flag, not the model, sets the limit.
    "n_ctx_train": 4096,
}
SPACE = "\u2581"  # SentencePiece's word-boundary mark
WORDS = (
    "the",
    "a",
    "tenant",
    "cache",
    "block",
    "prefix",
    "token",
    "secret",
    "canary",
    "nonce",
    "repeat",
    "exactly",
    "model",
    "server",
    "request",
    "answer",
    "memory",
    "page",
    "key",
    "value",
    "shared",
    "isolation",
    "leak",
    "probe",
    "monitor",
    "prompt",
    "reply",
    "number",
    "code",
    "word",
)
# Roles and turns in plain text: the vocabulary has no special tokens besides <unk>, <s> and </s>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TokenType = gguf.TokenType
FIRST_PIECE = 3 + 256  # ids below are <unk>, <s>, </s> and <0x00>..<0xFF>


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Return the tokens, their scores and their types, in id order (0 <unk>, 1 <s>, 2 </s>).

    llama.cpp's SPM tokenizer starts from single characters and keeps merging the adjacent pair
    whose union is the highest-scoring token, so every word comes with all of its prefixes.
    """
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    pieces: list[str] = [SPACE, *string.ascii_letters, *string.digits, *".,:;!?-_'\"()[]{}<>|/=+*#@%&"]
    for word in WORDS:
        marked = SPACE + word
        pieces += [marked[:n] for n in range(2, len(marked) + 1)]
    pieces = list(dict.fromkeys(pieces))  # keep the first of duplicates, in order
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)
    # Longer pieces win merges; specials and bytes never take part in them.
    scores = [0.0] * FIRST_PIECE + [float(len(p)) - i * 1e-4 for i, p in enumerate(pieces)]
    return tokens, scores, [int(t) for t in types]


def tensors(n_vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Return the llama tensors by GGUF name; numpy shapes are ggml's ``ne`` reversed."""
    e, ff = RECIPE["n_embd"], RECIPE["n_ff"]
    kv = RECIPE["n_head_kv"] * (e // RECIPE["n_head"])

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    out = {"token_embd.weight": weight(n_vocab, e), "output_norm.weight": ones(e)}
    for i in range(RECIPE["n_layer"]):
        blk = f"blk.{i}."
        out |= {
            blk + "attn_norm.weight": ones(e),
            blk + "attn_q.weight": weight(e, e),
            blk + "attn_k.weight": weight(kv, e),
            blk + "attn_v.weight": weight(kv, e),
            blk + "attn_output.weight": weight(e, e),
            blk + "ffn_norm.weight": ones(e),
            blk + "ffn_gate.weight": weight(ff, e),
            blk + "ffn_up.weight": weight(ff, e),
            blk + "ffn_down.weight": weight(e, ff),
        }
    head = weight(n_vocab, e)
    # Zero logits for <unk>, <s>, </s> and the byte tokens, against pieces whose best logit is about
    # +1: greedy decoding then emits only text pieces. Without this the random model ends answers
    # early with </s> or emits lone UTF-8 lead bytes, which llama-cpp-python holds back while it
    # keeps generating past max_tokens (see README.md); tests that want that use logit_bias.
    head[:FIRST_PIECE] = 0.0
    out["output.weight"] = head
    return out


def write(path: Path) -> None:
    """Write the model to ``path`` (atomically: a temporary sibling, then a rename)."""
    tokens, scores, types = vocabulary()
    rng = np.random.default_rng(RECIPE["seed"])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name("kvcanary-tiny")
    writer.add_context_length(RECIPE["n_ctx_train"])
    writer.add_embedding_length(RECIPE["n_embd"])
    writer.add_block_count(RECIPE["n_layer"])
    writer.add_feed_forward_length(RECIPE["n_ff"])
    writer.add_head_count(RECIPE["n_head"])
    writer.add_head_count_kv(RECIPE["n_head_kv"])
    writer.add_rope_dimension_count(RECIPE["n_embd"] // RECIPE["n_head"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, array in tensors(len(tokens), rng).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT.gguf", file=sys.stderr)
        return 2
    path = Path(argv[1])
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path)
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
