#!/usr/bin/env python3
"""Convert a Keel Llama model directory (config.json + model.safetensors + tokenizer.bin, as written
by `keel make-model --arch llama` or `keel convert`) to a GGUF v3 file that llama.cpp loads.

Python standard library only (no numpy, no gguf-py), so bench/engine/vs_llamacpp.sh runs on a bare
machine. The weights keep their values and their dtype (F32 -> F32, F16 -> F16, BF16 -> BF16) and
are copied byte for byte, with one exception and one reordering, both as llama.cpp's own
convert_hf_to_gguf.py does them:
  * 1-D tensors (the RMSNorm weights) are stored as F32: a lossless widening (llama.cpp's converter
    always writes them so, and they are 0.02% of the bytes);
  * q_proj/k_proj rows go from Hugging Face "rotate-half" order back to the interleaved-pair order
    llama.cpp's RoPE expects (convert_hf_to_gguf.py `LlamaModel.permute`).
The vocabulary is the llama2.c tokenizer.bin beside the model, written as a SentencePiece ("llama")
vocabulary of n_vocab pieces: ids 0..2 <unk>/<s>/</s>, 3..258 byte pieces, spaces as U+2581.

Usage: safetensors_to_gguf.py MODEL_DIR OUT.gguf
"""
import json
import os
import struct
import sys

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT

# gguf value types (gguf-py/gguf/constants.py GGUFValueType)
T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 6, 7, 8, 9
# ggml tensor types and llama_ftype (general.file_type)
GGML_TYPE = {"F32": 0, "F16": 1, "BF16": 30}
FILE_TYPE = {"F32": 0, "F16": 1, "BF16": 32}  # LLAMA_FTYPE_ALL_F32, MOSTLY_F16, MOSTLY_BF16
ELEM_SIZE = {"F32": 4, "F16": 2, "BF16": 2}
# SentencePiece token types (gguf-py TokenType)
TOK_NORMAL, TOK_UNKNOWN, TOK_CONTROL, TOK_BYTE = 1, 2, 3, 6


def pack_string(s):
    b = s if isinstance(s, bytes) else s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def pack_kv(key, vtype, value):
    out = pack_string(key) + struct.pack("<I", vtype)
    if vtype == T_UINT32:
        return out + struct.pack("<I", value)
    if vtype == T_FLOAT32:
        return out + struct.pack("<f", value)
    if vtype == T_BOOL:
        return out + struct.pack("<?", value)
    if vtype == T_STRING:
        return out + pack_string(value)
    raise ValueError(vtype)


def pack_array(key, etype, values):
    out = pack_string(key) + struct.pack("<IIQ", T_ARRAY, etype, len(values))
    if etype == T_STRING:
        return out + b"".join(pack_string(v) for v in values)
    if etype == T_FLOAT32:
        return out + struct.pack("<%df" % len(values), *values)
    if etype == T_INT32:
        return out + struct.pack("<%di" % len(values), *values)
    raise ValueError(etype)


def read_tokenizer(path, n_vocab):
    """llama2.c tokenizer.bin -> (pieces, scores, types) as SentencePiece would name them."""
    with open(path, "rb") as f:
        data = f.read()
    off = 4  # max_token_length
    pieces, scores, types = [], [], []
    for i in range(n_vocab):
        score, n = struct.unpack_from("<fi", data, off)
        off += 8
        raw = data[off:off + n]
        off += n
        if i == 0:
            piece, kind = b"<unk>", TOK_UNKNOWN
        elif i == 1:
            piece, kind = b"<s>", TOK_CONTROL  # llama2.c prints BOS/EOS as "\n<s>\n"
        elif i == 2:
            piece, kind = b"</s>", TOK_CONTROL
        elif 3 <= i <= 258:
            piece, kind = raw, TOK_BYTE  # "<0xNN>"
        else:
            piece, kind = raw.replace(b" ", "\u2581".encode("utf-8")), TOK_NORMAL
        pieces.append(piece)
        scores.append(score)
        types.append(kind)
    return pieces, scores, types


def unrotate_rows(data, rows, row_bytes, n_head):
    """HF rotate-half row order -> interleaved pairs: out row h*hd + 2j + i = in row h*hd + i*hd/2 + j."""
    hd = rows // n_head
    half = hd // 2
    out = bytearray(len(data))
    for h in range(n_head):
        for j in range(half):
            for i in range(2):
                src = (h * hd + i * half + j) * row_bytes
                dst = (h * hd + 2 * j + i) * row_bytes
                out[dst:dst + row_bytes] = data[src:src + row_bytes]
    return bytes(out)


def widen_to_f32(data, dtype):
    if dtype == "F32":
        return data
    n = len(data) // 2
    if dtype == "F16":
        return struct.pack("<%df" % n, *struct.unpack("<%de" % n, data))
    # BF16: the top half of an F32
    return b"".join(b"\x00\x00" + data[2 * k:2 * k + 2] for k in range(n))


def main(argv):
    if len(argv) != 3:
        sys.exit(__doc__)
    model_dir, out_path = argv[1], argv[2]
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    st_path = os.path.join(model_dir, "model.safetensors")
    st = open(st_path, "rb")
    (hdr_len,) = struct.unpack("<Q", st.read(8))
    header = json.loads(st.read(hdr_len))
    header.pop("__metadata__", None)
    data_base = 8 + hdr_len

    dim = cfg["hidden_size"]
    n_layer = cfg["num_hidden_layers"]
    n_head = cfg["num_attention_heads"]
    n_head_kv = cfg.get("num_key_value_heads", n_head)
    n_vocab = cfg["vocab_size"]
    head_dim = cfg.get("head_dim", dim // n_head)

    # (gguf name, safetensors name, heads for the RoPE row reordering or 0)
    plan = [("token_embd.weight", "model.embed_tokens.weight", 0)]
    for l in range(n_layer):
        p = "model.layers.%d." % l
        plan += [
            ("blk.%d.attn_norm.weight" % l, p + "input_layernorm.weight", 0),
            ("blk.%d.attn_q.weight" % l, p + "self_attn.q_proj.weight", n_head),
            ("blk.%d.attn_k.weight" % l, p + "self_attn.k_proj.weight", n_head_kv),
            ("blk.%d.attn_v.weight" % l, p + "self_attn.v_proj.weight", 0),
            ("blk.%d.attn_output.weight" % l, p + "self_attn.o_proj.weight", 0),
            ("blk.%d.ffn_norm.weight" % l, p + "post_attention_layernorm.weight", 0),
            ("blk.%d.ffn_gate.weight" % l, p + "mlp.gate_proj.weight", 0),
            ("blk.%d.ffn_up.weight" % l, p + "mlp.up_proj.weight", 0),
            ("blk.%d.ffn_down.weight" % l, p + "mlp.down_proj.weight", 0),
        ]
    plan.append(("output_norm.weight", "model.norm.weight", 0))
    if "lm_head.weight" in header and not cfg.get("tie_word_embeddings", False):
        plan.append(("output.weight", "lm_head.weight", 0))
    missing = [src for _, src, _ in plan if src not in header]
    if missing:
        sys.exit("safetensors_to_gguf: missing tensors: %s" % ", ".join(missing[:5]))
    if any(k.endswith(".bias") for k in header):
        sys.exit("safetensors_to_gguf: biases are not supported (llama without attention_bias only)")

    weight_dtype = header["model.embed_tokens.weight"]["dtype"]
    if weight_dtype not in GGML_TYPE:
        sys.exit("safetensors_to_gguf: unsupported dtype %s" % weight_dtype)

    pieces, scores, types = read_tokenizer(os.path.join(model_dir, "tokenizer.bin"), n_vocab)
    kvs = [
        pack_kv("general.architecture", T_STRING, "llama"),
        pack_kv("general.name", T_STRING, os.path.basename(os.path.normpath(model_dir))),
        pack_kv("general.file_type", T_UINT32, FILE_TYPE[weight_dtype]),
        pack_kv("general.alignment", T_UINT32, ALIGNMENT),
        pack_kv("llama.vocab_size", T_UINT32, n_vocab),
        pack_kv("llama.context_length", T_UINT32, cfg.get("max_position_embeddings", 2048)),
        pack_kv("llama.embedding_length", T_UINT32, dim),
        pack_kv("llama.block_count", T_UINT32, n_layer),
        pack_kv("llama.feed_forward_length", T_UINT32, cfg["intermediate_size"]),
        pack_kv("llama.rope.dimension_count", T_UINT32, head_dim),
        pack_kv("llama.attention.head_count", T_UINT32, n_head),
        pack_kv("llama.attention.head_count_kv", T_UINT32, n_head_kv),
        pack_kv("llama.attention.layer_norm_rms_epsilon", T_FLOAT32, cfg.get("rms_norm_eps", 1e-5)),
        pack_kv("llama.rope.freq_base", T_FLOAT32, float(cfg.get("rope_theta", 10000.0))),
        pack_kv("tokenizer.ggml.model", T_STRING, "llama"),
        pack_array("tokenizer.ggml.tokens", T_STRING, pieces),
        pack_array("tokenizer.ggml.scores", T_FLOAT32, scores),
        pack_array("tokenizer.ggml.token_type", T_INT32, types),
        pack_kv("tokenizer.ggml.unknown_token_id", T_UINT32, 0),
        pack_kv("tokenizer.ggml.bos_token_id", T_UINT32, cfg.get("bos_token_id", 1)),
        pack_kv("tokenizer.ggml.eos_token_id", T_UINT32, cfg.get("eos_token_id", 2)),
        pack_kv("tokenizer.ggml.add_bos_token", T_BOOL, True),
        pack_kv("tokenizer.ggml.add_eos_token", T_BOOL, False),
    ]

    # Tensor infos: ggml dims are innermost first, so HF [out, in] becomes ne = [in, out].
    infos, offset = [], 0
    for name, src, heads in plan:
        meta = header[src]
        shape = meta["shape"]
        out_dtype = "F32" if len(shape) == 1 else meta["dtype"]
        if len(shape) > 1 and meta["dtype"] != weight_dtype:
            sys.exit("safetensors_to_gguf: %s is %s, the model is %s" % (src, meta["dtype"], weight_dtype))
        n_elem = 1
        for d in shape:
            n_elem *= d
        nbytes = n_elem * ELEM_SIZE[out_dtype]
        infos.append((name, src, heads, list(reversed(shape)), out_dtype, offset, nbytes))
        offset += (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT

    tmp_path = out_path + ".tmp"
    with open(tmp_path, "wb") as out:
        out.write(GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(infos), len(kvs)))
        for kv in kvs:
            out.write(kv)
        for name, _, _, ne, out_dtype, off, _ in infos:
            out.write(pack_string(name) + struct.pack("<I", len(ne)))
            out.write(struct.pack("<%dQ" % len(ne), *ne))
            out.write(struct.pack("<IQ", GGML_TYPE[out_dtype], off))
        out.write(b"\x00" * (-out.tell() % ALIGNMENT))
        data_start = out.tell()
        for name, src, heads, ne, out_dtype, off, nbytes in infos:
            meta = header[src]
            begin, end = meta["data_offsets"]
            st.seek(data_base + begin)
            data = st.read(end - begin)
            if heads:
                rows = meta["shape"][0]
                data = unrotate_rows(data, rows, len(data) // rows, heads)
            if out_dtype != meta["dtype"]:
                data = widen_to_f32(data, meta["dtype"])
            assert len(data) == nbytes, name
            out.write(b"\x00" * (data_start + off - out.tell()))
            out.write(data)
        out.write(b"\x00" * (-out.tell() % ALIGNMENT))
    os.replace(tmp_path, out_path)
    print("wrote %s: %d tensors, %s weights, %d-token vocabulary" % (out_path, len(infos), weight_dtype, n_vocab))


if __name__ == "__main__":
    main(sys.argv)
