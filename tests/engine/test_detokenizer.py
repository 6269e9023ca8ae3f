"""IncrementalDetokenizer: incremental text equals a full decode, deltas, stop strings, held-back tails."""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.implementations import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.sampling_params import SamplingParams

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog. STOP signs are red.",
    "안녕하세요 세계! 한국어 텍스트를 토큰으로 나눕니다. 감사합니다.",
    "Emoji time 😀🎉👍🏽 and flags 🇰🇷 mixed with text 123 + 456 = 579.",
    "Mixed: hello 안녕 😀 world 세계 🎉 done.",
] * 20
EOS = "<|endoftext|>"
SPECIALS = [EOS, "<|im_start|>"]


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, additional_special_tokens=SPECIALS[1:], clean_up_tokenization_spaces=False
    )


def _byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return _wrap(tok)


def _gpt2_style() -> PreTrainedTokenizerFast:
    # GPT-2's ByteLevel setup (prefix space, trimmed offsets) via the tokenizers implementation.
    impl = ByteLevelBPETokenizer(add_prefix_space=True, trim_offsets=True)
    impl.train_from_iterator(CORPUS, vocab_size=450, min_frequency=1, special_tokens=SPECIALS)
    return _wrap(Tokenizer.from_str(impl.to_str()))


def _sentencepiece_style() -> PreTrainedTokenizerFast:
    """Llama-style: Metaspace "▁" words, BPE with <0xNN> byte fallback for characters outside the alphabet."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    # A small alphabet leaves most Korean syllables and all emoji to the byte fallback.
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, limit_alphabet=60, special_tokens=["<unk>", *SPECIALS])
    )
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return _wrap(tok)


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    return _byte_level()


@pytest.fixture(scope="module")
def sentencepiece() -> PreTrainedTokenizerFast:
    return _sentencepiece_style()


BYTE_LEVEL_FACTORIES = {"byte_level": _byte_level, "gpt2_style": _gpt2_style}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def byte_token_ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """One token per UTF-8 byte, so every multi-byte character and stop string is split across tokens."""
    table = _bytes_to_unicode()
    return [tokenizer.convert_tokens_to_ids(table[b]) for b in text.encode()]


def run(
    tokenizer: PreTrainedTokenizerFast,
    prompt_ids: list[int],
    output_ids: list[int],
    params: SamplingParams,
    rng: random.Random | None = None,
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feeds output_ids in chunks of 1-3 tokens (1 without rng); returns the detokenizer, the deltas
    (the last one from finished=True) and the stop string."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas, stop, i = [], None, 0
    while i < len(output_ids) and stop is None:
        step = rng.randint(1, 3) if rng else 1
        stop = detok.update(output_ids[i : i + step])
        i += step
        if stop is None:
            deltas.append(detok.get_next_output_text(finished=False, delta=True))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return detok, deltas, stop


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("name", sorted(BYTE_LEVEL_FACTORIES))
def test_random_ids_match_full_decode(name: str, skip_special_tokens: bool) -> None:
    tokenizer = BYTE_LEVEL_FACTORIES[name]()
    rng = random.Random(0)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for trial in range(300):
        # Any ids, specials included: sequences cut through multi-byte characters and hold stray bytes.
        output_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 40))]
        prompt_ids = tokenizer.encode(rng.choice(CORPUS)[: rng.randint(0, 40)]) if trial % 2 else []
        detok, deltas, _ = run(tokenizer, prompt_ids, output_ids, params, rng)
        expected = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
        assert detok.output_text == expected
        assert "".join(deltas) == expected
        assert detok.get_next_output_text(finished=True, delta=False) == expected


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_sentencepiece_style_matches_full_decode(
    sentencepiece: PreTrainedTokenizerFast, skip_special_tokens: bool
) -> None:
    tokenizer = sentencepiece
    rng = random.Random(1)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    chars = sorted(set("".join(CORPUS)))
    used_byte_fallback = False
    for trial in range(200):
        # Encoded text pieces joined by special tokens, so byte-fallback runs form whole characters: ByteFallback
        # turns a run holding any invalid byte into one U+FFFD per byte, even the part of the run decoded earlier.
        output_ids = []
        for piece in range(rng.randint(1, 3)):
            if piece:
                output_ids.append(tokenizer.convert_tokens_to_ids(rng.choice(SPECIALS)))
            output_ids += tokenizer.encode("".join(rng.choice(chars) for _ in range(rng.randint(0, 15))))
        used_byte_fallback |= any(t.startswith("<0x") for t in tokenizer.convert_ids_to_tokens(output_ids))
        prompt = rng.choice(CORPUS)[: rng.randint(1, 40)] if trial % 2 else ""
        prompt_ids = tokenizer.encode(prompt) if prompt else []
        detok, deltas, _ = run(tokenizer, prompt_ids, output_ids, params, rng)
        # After a prompt the first token keeps its in-context leading space, which a decode from the start strips.
        prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
        full = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=skip_special_tokens)
        assert full.startswith(prompt_text)
        expected = full[len(prompt_text) :]
        if not prompt_ids:
            assert expected == tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
        assert detok.output_text == expected
        assert "".join(deltas) == expected
    assert used_byte_fallback


def test_partial_utf8_character_is_held(byte_level: PreTrainedTokenizerFast) -> None:
    ids = byte_token_ids(byte_level, "a안😀")  # 1 + 3 + 4 bytes
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams())
    deltas = []
    for token_id in ids:
        detok.update([token_id])
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    assert deltas == ["a", "", "", "안", "", "", "", "😀"]
    assert all("\ufffd" not in d for d in deltas)


def test_unfinished_character_is_flushed_at_finish(byte_level: PreTrainedTokenizerFast) -> None:
    ids = byte_token_ids(byte_level, "ok😀")[:-1]
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams())
    for token_id in ids:
        detok.update([token_id])
    assert detok.get_next_output_text(finished=False, delta=True) == "ok"
    assert detok.get_next_output_text(finished=True, delta=True) == byte_level.decode(ids)[2:]
    assert detok.output_text == byte_level.decode(ids)


def test_skip_special_tokens(byte_level: PreTrainedTokenizerFast) -> None:
    ids = byte_level.encode("Hi") + [byte_level.eos_token_id] + byte_level.encode(" there")
    for skip, expected in [(True, "Hi there"), (False, f"Hi{EOS} there")]:
        detok, deltas, _ = run(byte_level, [], ids, SamplingParams(skip_special_tokens=skip))
        assert detok.output_text == expected == "".join(deltas)


@pytest.mark.parametrize("stop", ["STOP", "녕 s", "😀!"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(byte_level: PreTrainedTokenizerFast, stop: str, include: bool) -> None:
    before, after = "Hello 안녕 world ", " trailing text"
    text = before + stop + after
    params = SamplingParams(stop=["never", stop], include_stop_str_in_output=include)
    detok, deltas, matched = run(byte_level, [], byte_token_ids(byte_level, text), params)
    assert matched == stop == detok.stop_reason
    expected = before + stop if include else before
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert detok.get_next_output_text(finished=True, delta=False) == expected


def test_stop_string_inside_multi_token_update(byte_level: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["end"]))
    assert detok.update(byte_level.encode("the end of it")) == "end"
    assert detok.output_text == "the "


def test_earliest_stop_string_wins(byte_level: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["cd", "bc"]))
    assert detok.update(byte_level.encode("abcd")) == "bc"
    assert detok.output_text == "a"


@pytest.mark.parametrize("seed", range(5))
def test_held_back_tail_never_leaks_partial_stop(byte_level: PreTrainedTokenizerFast, seed: int) -> None:
    stops = ["STOP", "안녕히"]
    text = "a STO b ST 안녕 c S 안녕하 d STOP e"  # false starts of both stop strings before the real one
    expected = text[: text.index("STOP")]
    ids = byte_token_ids(byte_level, text) if seed == 0 else byte_level.encode(text)
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=stops))
    rng, emitted, i, matched = random.Random(seed), "", 0, None
    while matched is None:
        step = rng.randint(1, 3)
        matched = detok.update(ids[i : i + step])
        i += step
        if matched is None:
            emitted += detok.get_next_output_text(finished=False, delta=True)
            # Everything streamed so far survives the final truncation.
            assert expected.startswith(emitted)
            assert detok.get_next_output_text(finished=False, delta=False) == emitted
    assert matched == "STOP"
    emitted += detok.get_next_output_text(finished=True, delta=True)
    assert emitted == expected


def test_cumulative_mode_holds_back_tail(byte_level: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["STOP"]))
    detok.update(byte_level.encode("hello world"))
    assert detok.get_next_output_text(finished=False, delta=False) == "hello wo"
    assert detok.get_next_output_text(finished=True, delta=False) == "hello world"


def test_include_stop_str_holds_nothing_back(byte_level: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
    detok.update(byte_level.encode("hello ST"))
    assert detok.get_next_output_text(finished=False, delta=True) == "hello ST"
    assert detok.update(byte_level.encode("OP more")) == "STOP"
    assert detok.get_next_output_text(finished=True, delta=True) == "OP"


def test_stop_string_in_prompt_does_not_stop(byte_level: PreTrainedTokenizerFast) -> None:
    params = SamplingParams(stop=["STOP"])
    detok = IncrementalDetokenizer(byte_level, byte_level.encode("please STOP"), params)
    assert detok.update(byte_level.encode(" now")) is None
    assert detok.output_text == " now"
    # A stop string straddling the prompt/output boundary does not count either.
    detok = IncrementalDetokenizer(byte_level, byte_level.encode("say ST"), params)
    assert detok.update(byte_level.encode("OP it")) is None
    assert detok.output_text == "OP it"


def test_stop_strings_ignored_until_min_tokens(byte_level: PreTrainedTokenizerFast) -> None:
    ids = byte_token_ids(byte_level, "xSTOPySTOPz")
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["STOP"], min_tokens=6))
    # The first STOP ends at token 5 (<= min_tokens), the second at token 10.
    assert [detok.update([t]) for t in ids[:10]] == [None] * 9 + ["STOP"]
    assert detok.output_text == "xSTOPy"
