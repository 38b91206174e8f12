from helpers import PROMPT, PROMPT_IDS

from lmhead_cli.loading.tokenizer import GPT2Tokenizer


def test_bundled_tokenizer_matches_gpt2():
    tok = GPT2Tokenizer.bundled()
    assert tok.encode(PROMPT) == PROMPT_IDS
    assert tok.decode(PROMPT_IDS) == PROMPT
    assert tok.vocab_size == 50257
    assert tok.encode("<|endoftext|>") == [50256]


def test_bundled_tokenizer_agrees_with_transformers_on_mixed_text():
    import importlib.resources as r

    from transformers import GPT2Tokenizer as ReferenceTokenizer

    folder = r.files("lmhead_cli.data") / "gpt2-tokenizer"
    with r.as_file(folder) as path:
        ref = ReferenceTokenizer.from_pretrained(str(path))  # transformers' own GPT-2 tokenizer on the same files
    tok = GPT2Tokenizer.bundled()
    for text in [PROMPT, " leading space", "你好，世界", "日本語のテキスト 🙂🎉", "tabs\tand\nnewlines  ", "x" * 300]:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == text


def test_token_text_shows_bytes_of_partial_characters():
    tok = GPT2Tokenizer.bundled()
    ids = tok.encode("你")
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == "你".encode()
    if len(ids) > 1:  # a piece of a multi-byte character shows as escaped bytes, not U+FFFD
        assert "\ufffd" not in tok.token_text(ids[0])
        assert tok.token_text(ids[0]).startswith("\\x")
    assert tok.token_text(8251) == " keys"


def test_a_sentencepiece_style_tokenizer_json_maps_pieces_back_to_bytes(tmp_path):
    """Llama- and Gemma-style pieces: "▁" is a space and "<0xF0>" one raw byte (byte fallback), so the
    pieces' bytes join to exactly what the tokenizer's own decoder makes of the ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = [("<unk>", 0.0)] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    pieces += [(p, -1.0) for p in ["▁The", "▁keys", "▁on", "▁the", "▁table"]]
    sp = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    sp.save(str(tmp_path / "tokenizer.json"))

    tok = GPT2Tokenizer.from_folder(tmp_path)
    text = "The keys on the table\n😀"
    ids = tok.encode(text)
    assert len(ids) == 10  # five words, a newline byte and the emoji's four bytes
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == tok.decode(ids) == " " + text
    assert [tok.token_text(i) for i in ids[4:7]] == [" table", "\n", "\\xf0"]


def test_the_same_files_are_parsed_once_and_other_bytes_again(tmp_path, monkeypatch):
    import shutil

    import lmhead_cli.loading.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer, "_PARSED", {})
    src = resources_folder()
    for name in ("one", "two", "changed"):
        (tmp_path / name).mkdir()
        for f in ("vocab.json", "merges.txt"):
            shutil.copy(src / f, tmp_path / name / f)
    merges = tmp_path / "changed" / "merges.txt"
    lines = merges.read_text(encoding="utf-8").splitlines()
    merges.write_text("\n".join(lines[:-1]) + "\n", encoding="utf-8")  # the last merge gone
    one, two = (GPT2Tokenizer.from_folder(tmp_path / n) for n in ("one", "two"))
    changed = GPT2Tokenizer.from_folder(tmp_path / "changed")
    assert one.tok is two.tok  # same bytes in another folder: parsed once
    assert changed.tok is not one.tok and changed.encode(PROMPT) == PROMPT_IDS
    for i in range(tokenizer._PARSED_MAX + 2):  # bounded: the oldest entries go
        (tmp_path / f"v{i}").mkdir()
        shutil.copy(src / "vocab.json", tmp_path / f"v{i}" / "vocab.json")
        (tmp_path / f"v{i}" / "merges.txt").write_text("\n".join(lines[:-(i + 2)]) + "\n", encoding="utf-8")
        GPT2Tokenizer.from_folder(tmp_path / f"v{i}")
    assert len(tokenizer._PARSED) == tokenizer._PARSED_MAX
    assert GPT2Tokenizer.from_folder(tmp_path / "one").tok is not one.tok  # evicted, parsed again


def resources_folder():
    import importlib.resources as r
    from pathlib import Path

    return Path(str(r.files("lmhead_cli.data") / "gpt2-tokenizer"))
