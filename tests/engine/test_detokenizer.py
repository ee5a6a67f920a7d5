"""Incremental detokenization: for random token streams (multi-byte characters split over byte
tokens, invalid bytes, special tokens) the released text is always final (a prefix of the whole
decode) and ends equal to it, on a byte-level BPE (the demo's, as DeepSeek and gpt-oss ship) and on
a SentencePiece-style tokenizer whose decode of a suffix depends on what precedes it; the work per
token does not grow with the output; stop strings are found in the streamed text."""

import random

import pytest

from dayzero.engine.detokenizer import MAX_HELD, IncrementalDetokenizer
from dayzero.engine.sampling import SamplingParams, StopChecker

CHARS = "aé€日本語𐍈😀 \n"  # 1, 2, 3 and 4 UTF-8 bytes


class CountingTokenizer:
    """Counts the token ids passed to decode (the detokenizer's work)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, ids, **kwargs):
        self.calls.append(len(ids))
        return self.inner.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def byte_bpe():
    from transformers import AutoTokenizer

    from dayzero.demo import demo_checkpoint

    return AutoTokenizer.from_pretrained(demo_checkpoint())


@pytest.fixture(scope="module")
def metaspace():
    """A Llama-style tokenizer: "▁" word pieces, <0xNN> byte fallback, and a decoder that drops the
    space of the first piece of every decode (so a suffix decoded alone differs from it in context)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "▁the", "▁cat", "▁sat", "a", "ing", "▁a", "é", "▁日本"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _byte_ids(tokenizer, text: str) -> list[int]:
    """text as single-byte tokens: byte-level BPE alphabet symbols, or <0xNN> fallback pieces."""
    if "<0x41>" in tokenizer.get_vocab():
        return tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in text.encode()])
    return tokenizer.convert_tokens_to_ids([_BYTE_LEVEL[b] for b in text.encode()])


def _byte_level_alphabet() -> dict[int, str]:
    """The byte-level BPE symbol of every byte: printable Latin-1 bytes stand for themselves, the
    others for chr(256 + k) in byte order (the GPT-2 convention the demo's tokenizer uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b], extra = chr(256 + extra), extra + 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()


def _stream(tokenizer, rng: random.Random, length: int) -> list[int]:
    """Random runs: multi-byte characters split into byte tokens, random ids and special tokens;
    on a byte-level BPE also invalid UTF-8 (characters cut short, lone bytes among the random ids).
    Byte-fallback pieces get valid characters only: that decoder turns a whole run of byte pieces
    into U+FFFD once any byte of it is invalid, so no streamed text could equal its decode."""
    fallback = "<0x41>" in tokenizer.get_vocab()
    ids = [i for i in range(len(tokenizer)) if not (fallback and tokenizer.convert_ids_to_tokens(i).startswith("<0x"))]
    out: list[int] = []
    while len(out) < length:
        kind = rng.random()
        if kind < 0.4:
            out += _byte_ids(tokenizer, "".join(rng.choice(CHARS) for _ in range(rng.randint(1, 4))))
        elif kind < 0.55 and not fallback:
            out += _byte_ids(tokenizer, rng.choice(CHARS[1:8]))[:-1]  # a character cut short
        elif kind < 0.95:
            out.append(rng.choice(ids))
        else:
            out.append(rng.choice(tokenizer.all_special_ids))
    return out if fallback else out[:length]  # (a cut at `length` could end inside a character)


def _run(tokenizer, ids, skip_special_tokens=True):
    tokens: list[int] = []
    det = IncrementalDetokenizer(tokenizer, tokens, skip_special_tokens)
    released = []
    for t in ids:
        tokens.append(t)
        released.append(det.step())
    released.append(det.flush())
    return det, released


@pytest.mark.parametrize("name", ["byte_bpe", "metaspace"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_equals_the_whole_decode(name, skip_special_tokens, request):
    tokenizer = request.getfixturevalue(name)
    rng = random.Random(f"{name}-{skip_special_tokens}")
    for _ in range(30):
        ids = _stream(tokenizer, rng, rng.randint(1, 60))
        full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
        det, released = _run(tokenizer, ids, skip_special_tokens)
        assert det.text == full, ids
        so_far = ""
        for piece in released:  # released text is never taken back
            so_far += piece
            assert full.startswith(so_far), ids


def test_a_split_character_comes_out_whole(byte_bpe):
    ids = _byte_ids(byte_bpe, "a€b")
    det, released = _run(byte_bpe, ids)
    assert released == ["a", "", "", "€", "b", ""]


@pytest.mark.parametrize("name", ["byte_bpe", "metaspace"])
def test_work_per_token_does_not_grow_with_the_output(name, request):
    counting = CountingTokenizer(request.getfixturevalue(name))
    ids = _stream(counting.inner, random.Random(1), 3000)
    tokens: list[int] = []
    det = IncrementalDetokenizer(counting, tokens)
    per_step = []
    for t in ids:
        tokens.append(t)
        before = len(counting.calls)
        det.step()
        per_step.append(sum(counting.calls[before:]))
    assert max(per_step) <= 3 * 2 * (2 * MAX_HELD + 2)  # three decodes of at most a few held tokens
    assert sum(per_step[-500:]) <= 1.5 * sum(per_step[:500])  # the same at token 3000 as at token 1
    assert sum(per_step) < 20 * len(ids)  # a whole decode per step would be len(ids)**2 / 2


def test_stop_strings_in_the_released_text(byte_bpe):
    """The engine's flow (detokenizer piece -> stop checker): the output ends right before the first
    stop string of the whole decode, multi-byte stop strings included."""
    rng = random.Random(7)
    for _ in range(20):
        ids = _stream(byte_bpe, rng, 50)
        full = byte_bpe.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        visible = full.replace("\ufffd", "")
        if len(visible) < 4:
            continue
        i = rng.randrange(len(visible) - 2)
        stop = visible[i:i + rng.randint(1, 3)]
        params = SamplingParams(stop=[stop], max_tokens=len(ids))
        checker, tokens = StopChecker(params, None), []
        det = IncrementalDetokenizer(byte_bpe, tokens)
        for n, t in enumerate(ids, 1):
            tokens.append(t)
            piece = det.step() + (det.flush() if n == len(ids) else "")
            decision = checker.check(piece, t, n)
            if decision.finish_reason:
                break
        expected = full[:full.find(stop)] if stop in full else full
        assert det.text[:decision.length] == expected and decision.stop_reason == (stop if stop in full else None)
