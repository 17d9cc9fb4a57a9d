"""Write a tiny random-weight llama model as GGUF, for a real llama-cpp-python
server in tests (tests/acceptance/test_provider_outage_llama_cpp.py): 2 layers
of 64, a byte-fallback vocabulary, 0.5 MB. Its answers are noise, which is
all an outage test needs from a model. Run with the interpreter that has the
``gguf`` package (scripts/llama_server.sh sets one up)::

    python tests/support/tiny_gguf.py /tmp/tiny.gguf
"""

import sys

import gguf  # type: ignore[import-not-found]
import numpy as np

path = sys.argv[1]
n_embd, n_head, n_layer, n_ff, n_ctx = 64, 4, 2, 128, 2048
rng = np.random.default_rng(0)

tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + \
    [gguf.TokenType.BYTE] * 256
words = ["\u2581", "a", "e", "o", "t", "\u2581the", "\u2581ok", "done"]
tokens += words
types += [gguf.TokenType.NORMAL] * len(words)
scores = [0.0] * len(tokens)
n_vocab = len(tokens)

w = gguf.GGUFWriter(path, "llama")
w.add_name("solidloop-tiny")
w.add_context_length(n_ctx)
w.add_embedding_length(n_embd)
w.add_block_count(n_layer)
w.add_feed_forward_length(n_ff)
w.add_head_count(n_head)
w.add_head_count_kv(n_head)
w.add_layer_norm_rms_eps(1e-5)
w.add_rope_dimension_count(n_embd // n_head)
w.add_file_type(gguf.LlamaFileType.ALL_F32)
w.add_tokenizer_model("llama")
w.add_token_list(tokens)
w.add_token_scores(scores)
w.add_token_types(types)
w.add_bos_token_id(1)
w.add_eos_token_id(2)
w.add_unk_token_id(0)


def t(*shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.02).astype(np.float32)


w.add_tensor("token_embd.weight", t(n_vocab, n_embd))
w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
w.add_tensor("output.weight", t(n_vocab, n_embd))
for i in range(n_layer):
    p = f"blk.{i}."
    w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        w.add_tensor(p + name + ".weight", t(n_embd, n_embd))
    w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor(p + "ffn_gate.weight", t(n_ff, n_embd))
    w.add_tensor(p + "ffn_up.weight", t(n_ff, n_embd))
    w.add_tensor(p + "ffn_down.weight", t(n_embd, n_ff))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print("wrote", path, n_vocab, "tokens")
