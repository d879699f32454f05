"""hf.py: export to transformers' Llama / GPT-2 and import back, compared on logits (CPU, fp32);
safetensors weights; weights-only checkpoint reading."""
import copy
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import checkpoint  # noqa: E402
import fp4  # noqa: E402
import hf  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from train_helpers import (keep_global_rng, make_char_dataset,  # noqa: E402, F401 (autouse)
                           tiny_args)

transformers = pytest.importorskip("transformers")

ITOS = [chr(c) for c in range(32, 111)] + ["\n"]   # 80 characters: ' ' .. 'n' and newline
GPT2_STYLE = dict(norm="layernorm", mlp="gelu", pos_emb="learned")

def small_model(style, tie=False, bias=False, **kw):
    """A small random model whose norms and biases are not at their init values either (so a
    mapping that dropped them would show)."""
    cfg = GPTConfig(block_size=32, vocab_size=len(ITOS), n_layer=2, n_head=4, n_embd=64,
                    tie_embeddings=tie, bias=bias, **(GPT2_STYLE if style == "gpt2" else {}), **kw)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model

def save_ckpt(model, folder, meta=None):
    """A checkpoint as train.py writes it, numpy RNG state included."""
    os.makedirs(folder, exist_ok=True)
    meta = meta or dict(tokenizer="char", vocab_size=len(ITOS), itos=ITOS,
                        stoi={c: i for i, c in enumerate(ITOS)})
    checkpoint.save_checkpoint(dict(model=model.state_dict(), optimizer={}, iter_num=7,
                                    best_val_loss=1.5, config=dict(recipe="ufp4"),
                                    model_args=dataclasses.asdict(model.config), recipe="ufp4",
                                    meta=meta, rng=[checkpoint.rng_state()]),
                               os.path.join(folder, "ckpt.pt"))
    return folder

def logits(model, idx):
    with torch.no_grad():
        return model(idx, full_logits=True)[0]

def load_exported(hf_dir):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(hf_dir,
                                                                    output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    return model.eval()

@pytest.mark.parametrize("style,tie,bias", [("llama", False, False), ("llama", True, True),
                                            ("gpt2", True, False), ("gpt2", False, True)])
def test_export_matches_the_unquantized_forward(tmp_path, style, tie, bias):
    model = small_model(style, tie, bias)
    src = save_ckpt(model, str(tmp_path / "run"))
    summary = hf.export(src, str(tmp_path / "hf"))
    arch = "LlamaForCausalLM" if style == "llama" else "GPT2LMHeadModel"
    assert arch in summary and "char tokenizer" in summary
    theirs = load_exported(str(tmp_path / "hf"))
    assert type(theirs).__name__ == arch
    idx = torch.randint(0, len(ITOS), (3, 32))
    diff = (logits(model, idx) - theirs(idx).logits).abs().max().item()
    print(f"{style} tie={tie} bias={bias}: max |logit diff| {diff:.2e}")
    assert diff < 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "he hid me\nbad"
    assert tok.encode(text) == [ITOS.index(c) for c in text]
    assert tok.decode(tok.encode(text)) == text
    info = json.load(open(tmp_path / "hf" / "nanofp4.json"))
    assert info["recipe"] == "ufp4" and info["iter_num"] == 7 and info["meta"]["itos"] == ITOS
    assert json.load(open(tmp_path / "hf" / "char_vocab.json"))["itos"] == ITOS

def test_export_in_bf16_and_the_gpt2_tokenizer(tmp_path):
    from data.common import GPT2_EOT, get_gpt2_encoding
    model = small_model("gpt2", tie=True)
    src = save_ckpt(model, str(tmp_path / "run"), meta=dict(tokenizer="gpt2", vocab_size=50257,
                                                            eot_token=GPT2_EOT))
    assert "GPT-2 tokenizer" in hf.export(src, str(tmp_path / "hf"), dtype="bfloat16")
    theirs = load_exported(str(tmp_path / "hf"))
    assert theirs.dtype == torch.bfloat16 and theirs.config.eos_token_id == GPT2_EOT
    idx = torch.randint(0, len(ITOS), (2, 16))
    diff = (logits(model, idx) - theirs(idx).logits.float()).abs().max().item()
    assert 0 < diff < 0.1   # bf16 weights: close, not equal
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "Hello world!  The king's horse, 1234 <|endoftext|> ünïcode\n\nnew"
    assert tok.encode(text) == get_gpt2_encoding().encode(text, allowed_special="all")

def test_the_quantized_forward_differs_from_the_exported_one():
    """What export says: transformers runs the fp32 master weights, not the FP4 forward. The
    figure printed is the one the docs quote (relative RMS difference of the logits)."""
    model = small_model("llama")
    idx = torch.randint(0, len(ITOS), (4, 32))
    ref = logits(model, idx)
    quant = logits(fp4.convert(copy.deepcopy(model), "ufp4"), idx)
    rel = ((quant - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    top1 = (quant.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"ufp4 vs fp32 forward: relative RMS logit difference {rel:.4f}, max "
          f"{(quant - ref).abs().max().item():.4f}, top-1 agreement {top1:.3f}")
    assert 1e-3 < rel < 0.5

def test_export_refuses_what_has_no_equivalent(tmp_path):
    moe = save_ckpt(small_model("llama", n_expert=4, top_k=2), str(tmp_path / "moe"))
    with pytest.raises(hf.HFError, match="mixture-of-experts"):
        hf.export(moe, str(tmp_path / "out"))
    mixed = save_ckpt(small_model("llama", mlp="gelu"), str(tmp_path / "mixed"))
    with pytest.raises(hf.HFError, match="no Hugging Face equivalent"):
        hf.export(mixed, str(tmp_path / "out"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "hf.py"), "export",
                        str(tmp_path / "nothing"), str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "no checkpoint" in r.stderr

def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))
    model = small_model("llama")
    os.makedirs(tmp_path / "run")
    torch.save(dict(model=model.state_dict(), model_args=dataclasses.asdict(model.config),
                    extra=Evil()), str(tmp_path / "run" / "ckpt.pt"))
    with pytest.raises(hf.HFError, match="holds Python objects other than tensors.*refusing"):
        hf.read_checkpoint(str(tmp_path / "run"))
    assert not (tmp_path / "pwned").exists()

def test_export_checks_the_checkpoint_and_keeps_out_of_run_folders(tmp_path):
    run = save_ckpt(small_model("llama"), str(tmp_path / "run"))
    path = os.path.join(run, "ckpt.pt")
    with pytest.raises(hf.HFError, match="holds a nanoFP4 run"):   # would overwrite its weights
        hf.export(run, run)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01   # one bit inside the weights
    open(path, "wb").write(bytes(data))
    with pytest.raises(hf.HFError, match="corrupt"):
        hf.export(run, str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(hf.HFError, match="is a file: export into a folder"):
        hf.export(run, str(tmp_path / "a_file"))

@pytest.mark.parametrize("first,second", [("gpt2", "char"), ("char", "gpt2"), ("char", None),
                                          ("gpt2", None)])
def test_export_over_an_earlier_export_leaves_only_its_own_tokenizer(tmp_path, first, second):
    """An earlier export's tokenizer files would make the folder describe two tokenizers (or one
    the model does not use, None: a checkpoint without dataset meta): export removes them, and
    only them; the folder ends as a fresh export leaves it, plus the user's own file."""
    from data.common import GPT2_EOT
    model = small_model("gpt2", tie=True)
    def export(tok, hf_dir):
        if tok is None:
            src = hf.save_weights(model.state_dict(), str(tmp_path / "bare.safetensors"),
                                  metadata=dict(model_args=dataclasses.asdict(model.config)))
        else:
            meta = dict(tokenizer="gpt2", vocab_size=50257, eot_token=GPT2_EOT) if tok == "gpt2" \
                else None
            src = save_ckpt(model, str(tmp_path / f"run_{tok}"), meta=meta)
        return hf.export(src, str(tmp_path / hf_dir))
    export(first, "fresh_first")
    export(second, "fresh_second")
    export(first, "hf")
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    summary = export(second, "hf")
    files = set(os.listdir(tmp_path / "hf"))
    assert files == set(os.listdir(tmp_path / "fresh_second")) | {"notes.txt"}
    assert (tmp_path / "hf" / "notes.txt").read_text() == "mine"
    assert hf.tokenizer_of(str(tmp_path / "hf"))[0] == second
    stale = sorted(set(os.listdir(tmp_path / "fresh_first")) - files)
    assert stale and summary.endswith("removed the earlier export's " + ", ".join(
        f for f in hf.TOKENIZER_FILES if f in stale))
    assert "removed" not in export(second, "hf")   # the same tokenizer again: nothing stale
    (tmp_path / "mine").mkdir()   # a folder that holds no export: its files are the user's
    theirs = next(f for f in hf.TOKENIZER_FILES if f not in os.listdir(tmp_path / "fresh_second"))
    (tmp_path / "mine" / theirs).write_text("{}")
    export(second, "mine")
    assert (tmp_path / "mine" / theirs).read_text() == "{}"

def hf_model(kind, tmp_path, **kw):
    """A small random transformers model saved to a folder, its weights perturbed."""
    if kind == "llama":
        conf = transformers.LlamaConfig(vocab_size=80, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        max_position_embeddings=64, rms_norm_eps=hf.FP32_EPS,
                                        rope_theta=500000.0, **kw)
        model = transformers.LlamaForCausalLM(conf)
    else:
        conf = transformers.GPT2Config(vocab_size=80, n_positions=64, n_embd=64, n_layer=2,
                                       n_head=4, **kw)
        model = transformers.GPT2LMHeadModel(conf)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.eval().save_pretrained(str(tmp_path / kind))
    return model, str(tmp_path / kind)

@pytest.mark.parametrize("kind,kw", [
    ("llama", dict(tie_word_embeddings=False)),
    ("llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    ("gpt2", dict(activation_function="gelu")),
    ("gpt2", dict(activation_function="gelu", tie_word_embeddings=False))])
def test_import_round_trips_the_logits(tmp_path, kind, kw):
    theirs, folder = hf_model(kind, tmp_path, **kw)
    args, state = hf.load_hf(folder)
    ours = GPT(GPTConfig(**args)).eval()
    ours.load_state_dict(state)   # strict: every tensor has its place
    assert ours.config.tie_embeddings == theirs.config.tie_word_embeddings
    if args["tie_embeddings"]:
        assert ours.lm_head.weight is ours.wte.weight
    idx = torch.randint(0, 80, (2, 64))
    diff = (logits(ours, idx) - theirs(idx).logits).abs().max().item()
    print(f"import {kind} {kw}: max |logit diff| {diff:.2e}")
    assert diff < 1e-5
    # and the imported model trains under an FP4 recipe (an FP4 fine-tune's first step)
    tuned = fp4.convert(ours.train(), "ufp4")
    _, loss = tuned(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in tuned.parameters())

def test_import_notes_approximations_and_cuts_positions(tmp_path, capsys):
    theirs, folder = hf_model("gpt2", tmp_path)   # GPT-2's own tanh GELU
    args, state = hf.load_hf(folder, block_size=16)
    assert "gelu_new" in capsys.readouterr().err
    ours = GPT(GPTConfig(**args)).eval()
    ours.load_state_dict(state)
    idx = torch.randint(0, 80, (2, 16))
    diff = (logits(ours, idx) - theirs(idx).logits).abs().max().item()
    assert 0 < diff < 1e-2   # exact vs tanh GELU: close, not equal
    with pytest.raises(hf.HFError, match="exceeds the model.s 64 learned positions: pass --block_size=64 or less"):
        hf.load_hf(folder, block_size=128)

def test_import_refuses_what_model_py_cannot_express(tmp_path):
    _, folder = hf_model("llama", tmp_path, num_key_value_heads=2)
    with pytest.raises(hf.HFError, match="grouped-query"):
        hf.load_hf(folder)
    with pytest.raises(hf.HFError, match="no config.json"):
        hf.load_hf(str(tmp_path / "nothing"))

def test_safetensors_weights_round_trip_with_tied_embeddings(tmp_path):
    model = small_model("gpt2", tie=True)
    path = hf.save_weights(model.state_dict(), str(tmp_path / "model.safetensors"),
                           metadata=dict(model_args=dataclasses.asdict(model.config)))
    state, meta = hf.load_weights(path)
    assert json.loads(meta["model_args"]) == dataclasses.asdict(model.config)
    assert set(state) == set(model.state_dict())
    assert state["lm_head.weight"] is state["wte.weight"]   # stored once, tied again on load
    for k, v in model.state_dict().items():
        assert torch.equal(state[k], v), k
    from safetensors.torch import load_file   # and any safetensors reader takes the file
    assert len(load_file(path)) == len(state) - 1

def test_export_from_a_safetensors_file_with_model_args(tmp_path):
    model = small_model("llama")
    meta = dict(tokenizer="char", vocab_size=len(ITOS), itos=ITOS)
    path = hf.save_weights(model.state_dict(), str(tmp_path / "model.safetensors"),
                           metadata=dict(model_args=dataclasses.asdict(model.config),
                                         recipe="ufp4", iter_num=7, meta=meta))
    assert "char tokenizer" in hf.export(path, str(tmp_path / "hf"))
    idx = torch.randint(0, len(ITOS), (2, 32))
    theirs = load_exported(str(tmp_path / "hf"))
    assert (logits(model, idx) - theirs(idx).logits).abs().max() < 1e-5
    hf.save_weights(model.state_dict(), str(tmp_path / "bare.safetensors"))
    with pytest.raises(hf.HFError, match="no model_args"):
        hf.export(str(tmp_path / "bare.safetensors"), str(tmp_path / "hf2"))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(open(path, "rb").read()[:100])
    with pytest.raises(hf.HFError, match="a cut or damaged file"):
        hf.export(str(cut), str(tmp_path / "hf3"))

# -----------------------------------------------------------------------------
# train.py's init_from="hf:DIR" and its model.safetensors

def test_train_fine_tunes_an_imported_model_in_fp4_and_exports_it(tmp_path):
    """A Llama directory -> train.py (ufp4) -> checkpoint and model.safetensors -> export ->
    transformers: the architecture comes from the directory, the trained weights go back out."""
    import train
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    theirs, folder = hf_model("llama", tmp_path)
    train.main(tiny_args(ds, str(tmp_path / "out"), init_from=f"hf:{folder}", recipe="ufp4",
                         max_iters=4, eval_interval=4, n_layer=5, block_size=32))
    ckpt = hf.read_checkpoint(str(tmp_path / "out"))
    args = ckpt["model_args"]
    arch = (args["n_layer"], args["n_embd"], args["mlp_hidden"], args["vocab_size"])
    assert arch == (2, 64, 96, 80)   # the directory's, not the config's n_layer=5
    state, meta = hf.load_weights(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(state[k], v) for k, v in ckpt["model"].items())
    assert json.loads(meta["model_args"]) == args
    hf.export(str(tmp_path / "out"), str(tmp_path / "hf"))
    ours = GPT(GPTConfig(**args)).eval()
    ours.load_state_dict(ckpt["model"])
    idx = torch.randint(0, 80, (2, 32))
    assert (logits(ours, idx) - load_exported(str(tmp_path / "hf"))(idx).logits).abs().max() < 1e-5
    # it started from the directory's weights and trained: 4 AdamW steps move a weight by at most
    # about 4 learning rates (3e-3), where another init would differ by the init's own scale
    _, imported = hf.load_hf(folder, block_size=32)
    assert set(imported) == set(ckpt["model"])
    moved = max((ckpt["model"][k].float() - v.float()).abs().max().item() for k, v in imported.items())
    assert 1e-4 < moved < 5 * 3e-3, moved
    assert not torch.equal(logits(ours, idx), theirs(idx).logits)


def test_train_refuses_a_model_of_another_tokenizer(tmp_path, capsys):
    """init_from=hf:DIR on a dataset of another tokenizer trains token ids that mean other tokens:
    refused where the directory says its tokenizer, a warning where it holds none."""
    import train
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    itos = json.load(open(os.path.join(ds, "meta.json")))["itos"]
    _, folder = hf_model("llama", tmp_path)
    run = lambda: train.main(tiny_args(ds, str(tmp_path / "out"), init_from=f"hf:{folder}",
                                       dry_run=True, block_size=32))
    run()
    assert "holds no tokenizer files" in capsys.readouterr().out
    for vocab, match in ((itos[::-1], "a char tokenizer of other characters"), (itos, None)):
        with open(os.path.join(folder, "char_vocab.json"), "w") as f:
            json.dump({"tokenizer": "char", "itos": vocab}, f)
        if match:
            with pytest.raises(train.ConfigError, match=match):
                run()
        else:
            run()
            assert "holds no tokenizer files" not in capsys.readouterr().out
    os.remove(os.path.join(folder, "char_vocab.json"))
    open(os.path.join(folder, "tokenizer.json"), "w").write("{}")
    with pytest.raises(train.ConfigError, match=r"its own tokenizer \(tokenizer.json\), dataset "
                                                r"'tiny' is char-tokenized"):
        run()
    with open(os.path.join(folder, "vocab.json"), "w") as f:   # GPT-2's BPE: 50257 entries + merges
        json.dump({f"t{i}": i for i in range(50257)}, f)
    open(os.path.join(folder, "merges.txt"), "w").write("#version: 0.2\n")
    assert hf.tokenizer_of(folder) == ("gpt2", None)
    with pytest.raises(train.ConfigError, match="a gpt2 tokenizer, dataset 'tiny' is char-tokenized"):
        run()
