"""Stopping and streaming: max_new_tokens, EOS, stop token ids, stop strings (no text
past them), streams that carry several tokens per step without ever splitting a
multi-byte character, and cancelled or disconnected clients freeing their KV."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_model import tiny_model, tiny_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from verifier_harness import reference_greedy, run_verifier, spec_config, token_request
from verifier_support import (
    WAIT_S,
    EngineSpy,
    byte_token_ids,
    engine_of,
    one_torch_thread,  # noqa: F401 - autouse fixture
    scripted_model,
    stream_all,
    stream_request,
    wait_until,
)

from drafter_sdk.proto import verifier_pb2
from verifier_service.engine.detokenizer import CONTEXT_TOKENS, Detokenizer, decoder

# A model that writes "Hi 東京🙂é!" over and over, one UTF-8 byte per token
# (the CJK characters and the emoji span 3 and 4 tokens, é two).
TEXT = "Hi 東京🙂é!"
CHAIN = byte_token_ids(TEXT)
PROMPT = CHAIN * 2 + CHAIN[:1]  # two cycles, so the n-gram drafter proposes whole runs
STOP = verifier_pb2.FINISH_REASON_STOP
LENGTH = verifier_pb2.FINISH_REASON_LENGTH


def cycle_text(n_tokens: int) -> str:
    ids = [CHAIN[(1 + i) % len(CHAIN)] for i in range(n_tokens)]
    return tiny_tokenizer().decode(ids)


def stopping(**fields: object) -> verifier_pb2.StoppingCriteria:
    return verifier_pb2.StoppingCriteria(**fields)


def ids_request(ids: list[int], stop: verifier_pb2.StoppingCriteria) -> verifier_pb2.GenerateRequest:
    return verifier_pb2.GenerateRequest(params=verifier_pb2.GenerationParams(token_ids=verifier_pb2.TokenIds(ids=ids),
                                                                             stopping=stop))


@pytest.fixture(scope="module")
def script_model():  # noqa: ANN201
    return scripted_model(CHAIN)


def check_stream(messages: list[verifier_pb2.GenerateStreamResponse]) -> tuple[str, list[int]]:
    """Whole characters in every message; the last one alone carries the finish reason."""
    for m in messages:
        assert "\ufffd" not in m.output.text, f"a message split a character: {m.output.text!r}"
    assert all(m.output.finish_reason == verifier_pb2.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    assert messages[-1].output.finish_reason != verifier_pb2.FINISH_REASON_UNSPECIFIED
    return "".join(m.output.text for m in messages), [t for m in messages for t in m.output.token_ids]


@pytest.mark.parametrize("mode", ["NONE", "NGRAM"])
def test_stream_releases_whole_characters_and_several_tokens_per_step(script_model, mode: str) -> None:  # noqa: ANN001
    n = 3 * len(CHAIN)

    async def main() -> None:
        async with run_verifier(spec_config(mode, 8), model=script_model) as v:
            messages = await stream_all(v.stub, stream_request(PROMPT, n))
            unary = await v.stub.Generate(token_request(PROMPT, n), timeout=WAIT_S)
        text, ids = check_stream(messages)
        assert ids == list(unary.output.token_ids) and len(ids) == n
        assert text == unary.output.text == cycle_text(n)
        assert messages[-1].output.finish_reason == LENGTH
        assert messages[-1].output.stats.num_steps == unary.output.stats.num_steps
        if mode == "NGRAM":
            assert max(len(m.output.token_ids) for m in messages) > 2, "no step streamed several tokens"
            assert unary.output.stats.num_accepted_tokens > n // 2
        else:  # one token a step: a character's first bytes go out before the rest, with no text yet
            assert any(m.output.token_ids and not m.output.text for m in messages)

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["NONE", "NGRAM"])
@pytest.mark.parametrize("keep", [False, True])
def test_stop_string_cuts_text_and_tokens(script_model, mode: str, keep: bool) -> None:  # noqa: ANN001
    """Stop at the first "京🙂": nothing after it is returned, nor the stop string itself unless
    include_stop_str_in_output, even when the whole cycle is accepted in one step."""

    async def main() -> None:
        async with run_verifier(spec_config(mode, 8), model=script_model) as v:
            params = verifier_pb2.GenerationParams(token_ids=verifier_pb2.TokenIds(ids=PROMPT), stopping=stopping(
                max_new_tokens=60, stop=["京🙂", "zz"], include_stop_str_in_output=keep))
            unary = await v.stub.Generate(verifier_pb2.GenerateRequest(params=params), timeout=WAIT_S)
            messages = await stream_all(v.stub, verifier_pb2.GenerateStreamRequest(params=params))
        text, ids = check_stream(messages)
        assert unary.output.text == text == ("i 東京🙂" if keep else "i 東")
        assert unary.output.finish_reason == messages[-1].output.finish_reason == STOP
        assert unary.output.stop_reason == messages[-1].output.stop_reason == "京🙂"
        # Tokens up to the one completing the stop string ("i", " ", 東 x3, 京 x3, 🙂 x4).
        assert list(unary.output.token_ids) == ids == [CHAIN[(1 + i) % len(CHAIN)] for i in range(12)]

    asyncio.run(main())


def test_stop_string_across_steps_and_held_back_prefixes(script_model) -> None:  # noqa: ANN001
    """A text that could start a stop string is held back until decided; a stop
    string that never completes costs nothing at the end."""

    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=script_model) as v:
            # "é!X" never occurs ("é!" is always followed by "H"): everything comes out, in order.
            messages = await stream_all(v.stub, verifier_pb2.GenerateStreamRequest(params=verifier_pb2.GenerationParams(
                token_ids=verifier_pb2.TokenIds(ids=PROMPT), stopping=stopping(max_new_tokens=40, stop=["é!X"]))))
            text, _ = check_stream(messages)
            assert text == cycle_text(40) and messages[-1].output.finish_reason == LENGTH
            # While "é!" could still become "é!X", it is not released: no message ends inside it.
            released = ""
            for m in messages[:-1]:
                released += m.output.text
                assert not released.endswith("é") and not released.endswith("é!")
            # A stop string reaching into the second cycle: "!Hi" stops after "…é".
            r = await v.stub.Generate(verifier_pb2.GenerateRequest(params=verifier_pb2.GenerationParams(
                token_ids=verifier_pb2.TokenIds(ids=PROMPT), stopping=stopping(max_new_tokens=40, stop=["!Hi"]))),
                timeout=WAIT_S)
            assert r.output.text == "i 東京🙂é" and r.output.stop_reason == "!Hi" and r.output.finish_reason == STOP

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["NONE", "NGRAM"])
def test_max_new_tokens_stop_token_ids_and_eos(mode: str) -> None:
    """The token that ends the answer (a stop token id, the end of sequence) is in its tokens but not, as in
    vLLM, in its text, unless include_stop_str_in_output keeps it."""
    tok_x = CHAIN[TEXT.index("i")]  # "i" is the first generated token; stop at the space after it instead
    space = CHAIN[2]
    bang = CHAIN[-1]
    model = scripted_model(CHAIN)
    model.generation_config.eos_token_id = bang  # "!" is this model's end of sequence

    async def main() -> None:
        async with run_verifier(spec_config(mode, 8), model=model) as v:
            gen = v.stub.Generate
            r = await gen(token_request(PROMPT, 5), timeout=WAIT_S)
            assert len(r.output.token_ids) == 5 and r.output.finish_reason == LENGTH and r.output.text == cycle_text(5)
            r = await gen(ids_request(PROMPT, stopping(max_new_tokens=30, stop_token_ids=[space, 5])), timeout=WAIT_S)
            assert list(r.output.token_ids) == [tok_x, space] and r.output.finish_reason == STOP
            assert r.output.stop_reason == str(space)
            assert r.output.text == "i"
            r = await gen(ids_request(PROMPT, stopping(max_new_tokens=30, stop_token_ids=[space],
                                                       include_stop_str_in_output=True)), timeout=WAIT_S)
            assert list(r.output.token_ids) == [tok_x, space] and r.output.text == "i "
            r = await gen(token_request(PROMPT, 30), timeout=WAIT_S)  # EOS after "é": "!" ends it
            assert list(r.output.token_ids) == CHAIN[1:] and r.output.finish_reason == STOP
            assert r.output.stop_reason == ""
            assert r.output.text == TEXT[1:-1]
            streamed = await stream_all(v.stub, stream_request(PROMPT, 30))
            assert check_stream(streamed) == (TEXT[1:-1], CHAIN[1:])
            assert list(r.output.token_ids) == reference_greedy(model, PROMPT, 30)  # generate() stops there too
            r = await gen(ids_request(PROMPT, stopping(max_new_tokens=30, ignore_eos=True)), timeout=WAIT_S)
            assert len(r.output.token_ids) == 30 and r.output.finish_reason == LENGTH

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["NONE", "NGRAM"])
def test_min_new_tokens_holds_eos_stop_token_ids_and_stop_strings(mode: str) -> None:
    """vLLM's min_tokens: before it, the end of sequence and the stop token ids cannot come next (as
    transformers' min_new_tokens holds EOS back), and a stop string counts only where it starts after
    the text of those tokens; drafts change none of it."""
    bang, space = CHAIN[-1], CHAIN[2]
    model = scripted_model(CHAIN)
    model.generation_config.eos_token_id = bang  # "!" (the 15th generated token) is the end of sequence
    x = torch.tensor([PROMPT])

    def generate(min_new_tokens: int, eos: list[int]) -> list[int]:  # stop token ids are more ends to generate()
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=30, min_new_tokens=min_new_tokens,
                              eos_token_id=eos, do_sample=False)[0, len(PROMPT):].tolist()

    want = generate(20, [bang])
    assert bang not in want[:20] and len(want) >= 20
    want_space = generate(4, [bang, space])
    assert space not in want_space[:4] and want_space != [CHAIN[1], space]

    async def main() -> None:
        async with run_verifier(spec_config(mode, 8), model=model) as v:
            gen = v.stub.Generate
            r = await gen(ids_request(PROMPT, stopping(max_new_tokens=30, min_new_tokens=20)), timeout=WAIT_S)
            assert list(r.output.token_ids) == want
            r = await gen(ids_request(PROMPT, stopping(max_new_tokens=30, min_new_tokens=4, stop_token_ids=[space])),
                          timeout=WAIT_S)
            assert list(r.output.token_ids) == want_space
            # "i 東" starts the text of the first 3 tokens: only its next occurrence, a cycle later, stops.
            r = await gen(ids_request(PROMPT, stopping(max_new_tokens=40, min_new_tokens=3, stop=["i 東"],
                                                       ignore_eos=True)), timeout=WAIT_S)
            assert r.output.text == "i 東京🙂é!H" and r.output.stop_reason == "i 東"
            assert r.output.finish_reason == STOP
            assert list(r.output.token_ids) == [CHAIN[(1 + i) % len(CHAIN)] for i in range(21)]
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await gen(ids_request(PROMPT, stopping(max_new_tokens=3, min_new_tokens=4)), timeout=WAIT_S)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "more than max_new_tokens" in bad.value.details()

    asyncio.run(main())


def test_eos_on_the_random_model_matches_generate() -> None:
    prompt = [17, 42, 99, 42, 17]
    ref = reference_greedy(tiny_model(), prompt, 24)
    cut = next(i for i in range(4, 24) if ref[i] not in ref[:i])
    model = tiny_model()
    model.generation_config.eos_token_id = ref[cut]

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=model) as v:
            r = await v.stub.Generate(token_request(prompt, 24), timeout=WAIT_S)
        assert list(r.output.token_ids) == ref[:cut + 1] == reference_greedy(model, prompt, 24)
        assert r.output.finish_reason == STOP

    asyncio.run(main())


def test_the_tokenizers_end_of_sequence_ends_an_answer_as_the_generation_configs_does() -> None:
    """A model whose generation_config.json names another end of sequence than its tokenizer stops at either,
    as vLLM does (it adds the generation config's ids to the tokenizer's); ignore_eos passes both."""
    tokenizer_eos = tiny_tokenizer().eos_token_id
    chain = [CHAIN[0], CHAIN[1], CHAIN[2], tokenizer_eos, CHAIN[3], CHAIN[4]]
    model = scripted_model(chain)
    model.generation_config.eos_token_id = [CHAIN[4]]

    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=model) as v:
            first = await v.stub.Generate(token_request([CHAIN[0]], 20), timeout=WAIT_S)
            second = await v.stub.Generate(token_request([tokenizer_eos], 20), timeout=WAIT_S)
            through = await v.stub.Generate(ids_request([CHAIN[0]], stopping(max_new_tokens=8, ignore_eos=True)),
                                            timeout=WAIT_S)
        assert list(first.output.token_ids) == [CHAIN[1], CHAIN[2], tokenizer_eos]
        assert first.output.finish_reason == STOP
        assert list(second.output.token_ids) == [CHAIN[3], CHAIN[4]] and second.output.finish_reason == STOP
        assert list(through.output.token_ids) == [*chain[1:], CHAIN[0], CHAIN[1], CHAIN[2]]

    asyncio.run(main())


def held_slots(engine) -> int:  # noqa: ANN001
    """KV slots held for requests (the prefix cache's idle ones are free to evict)."""
    return engine.runner.kv_cache.num_used_slots - engine.scheduler.prefix_cache.num_idle


def test_cancelled_stream_frees_its_kv_at_the_next_step() -> None:
    model = scripted_model(CHAIN)

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=model) as v:
            engine = engine_of(v)
            spy = EngineSpy(engine)
            cancelled_at: list[int] = []
            dropped_at: list[int] = []
            cancel, schedule = engine.cancel, engine.scheduler.schedule

            def spy_cancel(seq) -> None:  # noqa: ANN001
                cancelled_at.append(len(spy.steps))
                cancel(seq)

            def spy_schedule(*price):  # noqa: ANN002, ANN202
                plan = schedule(*price)
                if plan.released:
                    dropped_at.append(len(spy.steps))
                return plan

            engine.cancel, engine.scheduler.schedule = spy_cancel, spy_schedule
            other = asyncio.ensure_future(v.stub.Generate(token_request(PROMPT, 200), timeout=WAIT_S))
            call = v.stub.GenerateStream(stream_request(PROMPT, 200), timeout=WAIT_S)
            first = await call.read()
            assert first.output.token_ids
            await wait_until(lambda: held_slots(engine) == 2, "both requests to run")
            call.cancel()
            await wait_until(lambda: held_slots(engine) == 1, "the cancelled stream's KV to be freed")
            assert cancelled_at and dropped_at and dropped_at[0] <= cancelled_at[0] + 1
            # The drafter forgot it too (in-process n-gram: its sequence store).
            store = engine.drafter.transport._servicer.store
            await wait_until(lambda: len(store) <= 1, "the drafter to release the cancelled request")
            r = await other  # the neighbour is unaffected
            assert len(r.output.token_ids) == 200 and r.output.text == cycle_text(200)
            await wait_until(lambda: held_slots(engine) == 0 and len(store) == 0, "everything released")

    asyncio.run(main())


def test_disconnected_unary_client_and_cancelled_queued_request_free_everything() -> None:
    model = scripted_model(CHAIN)

    async def main() -> None:
        async with run_verifier(spec_config("NGRAM", 4), model=model, max_num_seqs=1) as v:
            engine = engine_of(v)
            spy = EngineSpy(engine)
            # A client that goes away: its channel closes mid-generation.
            channel = grpc.aio.insecure_channel(v.address)
            stub = type(v.stub)(channel)
            running = asyncio.ensure_future(stub.Generate(token_request(PROMPT, 200), timeout=WAIT_S))
            await wait_until(lambda: engine.scheduler.num_running == 1, "the request to run", running)
            spy.gate.clear()
            queued = v.stub.GenerateStream(stream_request(PROMPT, 50), timeout=WAIT_S)
            await wait_until(lambda: engine.scheduler.num_waiting == 1, "the second request to queue")
            waiting = engine.scheduler.waiting[0]
            queued.cancel()  # never admitted
            # The cancel travels to the server on its own; the engine must not step before it has arrived.
            await wait_until(lambda: waiting.cancelled, "the server to see the cancel")
            await channel.close()
            spy.gate.set()
            with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)):
                await running
            await wait_until(lambda: held_slots(engine) == 0 and not engine.scheduler.has_work(),
                             "the engine to be idle")
            assert sum(s.admitted for s in spy.steps) == 1, "the cancelled queued request was admitted"
            r = await v.stub.Generate(token_request(PROMPT, 4), timeout=WAIT_S)  # and it still serves
            assert len(r.output.token_ids) == 4

    asyncio.run(main())


ALPHABET = "ab éü東京🙂\n"


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=st.text(alphabet=ALPHABET, min_size=1, max_size=30), keep=st.booleans(), data=st.data())
def test_detokenizer_streams_whole_characters_and_cuts_at_the_first_stop_string(text: str, keep: bool,
                                                                                 data) -> None:  # noqa: ANN001
    """Property: fed token by token, the released chunks never hold a broken
    character and add up to the text up to the first stop string, or through it
    when it is kept (all of the text when none occurs)."""
    tok = tiny_tokenizer()
    stops = tuple(data.draw(st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3)))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    detok = Detokenizer(tok, stops, include_stop_str=keep)
    chunks = []
    for token in ids:
        detok.add(token)
        if detok.stopped_by is not None:
            break
        chunks.append(detok.take())
    detok.flush()
    chunks.append(detok.take(final=True))
    # Generation stops at the first token after which some stop string is in the
    # (whole-character) text; the text is cut where the earliest one starts.
    expected = text
    for m in range(1, len(ids) + 1):
        so_far = tok.decode(ids[:m])
        hits = [(i, s) for s in stops if (i := so_far.find(s)) >= 0]
        if hits and not so_far.endswith("\ufffd"):
            index, stop = min(hits)  # the earliest; of two starting there, the one that sorts first
            expected = so_far[:index + len(stop) if keep else index]
            break
    assert "".join(chunks) == expected
    assert not any("\ufffd" in c for c in chunks)
    assert (detok.stopped_by is not None) == any(s in text for s in stops)


class Shouting(PreTrainedTokenizerFast):
    """A tokenizer class of its own decoding: its text is not the Rust decode's."""

    def _decode(self, *args, **kwargs) -> str:  # noqa: ANN002, ANN003
        return super()._decode(*args, **kwargs).upper()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(ids=st.lists(st.integers(0, len(tiny_tokenizer()) - 1), max_size=12), skip=st.booleans())
def test_the_detokenizers_decode_is_the_tokenizers(ids: list[int], skip: bool) -> None:
    """The Rust decode the detokenizer calls directly gives what `tokenizer.decode` gives (special
    tokens kept or skipped, bytes of a character cut anywhere), without going through it; a class
    that decodes in its own way, or a tokenizer that cleans up spaces, is decoded through it."""
    tok = tiny_tokenizer()
    expected = tok.decode(ids, skip_special_tokens=skip)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<eos>")
    fast.decode = None  # the direct path never calls it
    assert decoder(fast)(ids, skip) == expected
    shouting = Shouting(tokenizer_object=tok.backend_tokenizer, eos_token="<eos>")
    assert decoder(shouting)(ids, skip) == expected.upper()
    cleaning = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<eos>",
                                       clean_up_tokenization_spaces=True)
    assert decoder(cleaning)(ids, skip) == cleaning.decode(ids, skip_special_tokens=skip)


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Words as Llama 2's and Mistral's tokenizers write them ("▁word", the space a word's token carries
    dropped where a decode starts), over the tiny model's 400 ids; id 0 is its end of sequence."""
    words = {"<eos>": 0, "<unk>": 1} | {f"▁w{i}": i for i in range(2, len(tiny_tokenizer()))}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def after_prompt(tok: PreTrainedTokenizerFast, prompt: list[int], output: list[int]) -> str:
    """The output's text as it stands in the whole text: what follows the prompt's."""
    return tok.decode(prompt + output)[len(tok.decode(prompt)):]


def released(detok: Detokenizer, ids: list[int]) -> str:
    chunks = []
    for token in ids:
        detok.add(token)
        chunks.append(detok.take())
    detok.flush()
    return "".join(chunks) + detok.take(final=True)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(prompt=st.text(alphabet=ALPHABET, min_size=1, max_size=20), text=st.text(alphabet=ALPHABET, max_size=20),
       cut=st.integers(0, 3))
def test_a_text_is_decoded_after_its_prompt(prompt: str, text: str, cut: int) -> None:
    """Property: a detokenizer given the prompt's last tokens releases the output's text as it stands
    after the prompt in the whole text. A prompt that ends inside a character (its last `cut` tokens
    dropped may cut one) is not used as context: the text is then the output's own decode, as before."""
    tok = tiny_tokenizer()
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    prompt_ids = prompt_ids[:len(prompt_ids) - min(cut, len(prompt_ids) - 1)]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    got = released(Detokenizer(tok, context=prompt_ids[-CONTEXT_TOKENS:]), ids)
    broken = tok.decode(prompt_ids[-CONTEXT_TOKENS:]).endswith("\ufffd")
    assert got == (tok.decode(ids) if broken else after_prompt(tok, prompt_ids, ids))


def test_the_first_word_keeps_its_space_after_the_prompt_with_a_sentencepiece_tokenizer() -> None:
    """With Llama 2's or Mistral's kind of tokenizer, a text decoded alone would lose the space between the
    prompt and its first word ("isParis"); decoded after the prompt, as vLLM does, it keeps it: through the
    verifier, streamed and whole, and with the prompt echoed over HTTP."""
    tok = sentencepiece_tokenizer()
    prompt = [5, 17, 42, 99, 7, 250]
    alone = Detokenizer(tok)
    assert released(alone, [12, 13]) == "w12 w13"  # the space dropped where a decode starts

    async def main() -> None:
        async with run_verifier(spec_config("NONE"), model=tiny_model(), tokenizer=tok) as v:
            whole = await v.stub.Generate(token_request(prompt, 8), timeout=WAIT_S)
            streamed = await stream_all(v.stub, stream_request(prompt, 8))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{v.running.http_port}", timeout=WAIT_S) as http:
                echoed = (await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8,
                                                                   "echo": True, "temperature": 0})).json()
        output = list(whole.output.token_ids)
        assert output and 0 not in output[:-1]
        expected = after_prompt(tok, prompt, output if output[-1] else output[:-1])
        assert expected.startswith(" ") and whole.output.text == expected
        assert "".join(m.output.text for m in streamed) == expected
        assert echoed["choices"][0]["text"] == tok.decode(prompt) + expected

    asyncio.run(main())
