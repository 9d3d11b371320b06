"""generation/step_logits.py: a CPU rollout's LM head writes every decoding step's logits of a generate() call into
one kept buffer, and generate()'s float32 copy of them is a view of it: the same tokens and log-probs bit for bit, and
no [rows, vocab] block allocated per step (torch's profiler, against the head's own forward in the same test). What
that does to the C heap's minor faults is measured in bench/probes/tool_rollout_cpu.py."""

import contextlib

import torch
from torch.profiler import ProfilerActivity, profile

from grpo_lab.generation.step_logits import KeptLogits, keeps_logits, kept_logits


def test_the_kept_head_gives_the_heads_own_logits_bit_for_bit():
    torch.manual_seed(0)
    head = torch.nn.Linear(96, 5000, bias=False)
    hidden = torch.randn(6, 7, 96)
    kept = KeptLogits(head)
    with torch.no_grad():  # (as a rollout decodes: with autograd on, the head's own forward)
        check_steps(kept, head, hidden)
    assert kept(hidden[:, -1:, :]).requires_grad and kept.made == 2
    assert not keeps_logits(head, "cuda") and not keeps_logits(head, "cpu", compiled=True)
    assert not keeps_logits(torch.nn.Linear(4, 8), "cpu")  # (a bias: left alone)
    assert keeps_logits(head, "cpu")


def test_a_lower_precision_heads_float32_copy_is_a_second_kept_buffer():
    torch.manual_seed(0)
    head = torch.nn.Linear(96, 5000, bias=False).to(torch.bfloat16)
    kept = KeptLogits(head)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 1, 96, dtype=torch.bfloat16)
            copy = kept(x)[:, -1].to(copy=True, dtype=torch.float32, device="cpu")
            assert copy.dtype == torch.float32 and copy.data_ptr() == kept.scores.data_ptr() != kept.buffer.data_ptr()
            assert torch.equal(copy, head(x)[:, -1].float())
    assert kept.made == 1


def check_steps(kept, head, hidden):
    for x in (hidden[:, -1:, :], hidden[:, -1:, :].contiguous(), hidden[:3, 2:3, :].contiguous()):
        out = kept(x)
        assert out.data_ptr() == kept.buffer.data_ptr() and torch.equal(out, head(x))
        # generate()'s float32 copy (transformers' _sample): a new view of the buffer each step, the same values
        copy = out[:, -1].to(copy=True, dtype=torch.float32, device=x.device)
        again = out[:, -1].to(copy=True, dtype=torch.float32, device=x.device)
        assert type(copy) is torch.Tensor and copy is not again and copy.data_ptr() == kept.buffer.data_ptr()
        assert torch.equal(copy, head(x)[:, -1])
        assert out[:, -1].to(dtype=torch.float64).dtype == torch.float64  # any other conversion: the tensor's own
    assert kept.made == 2  # 6 rows, then 3: one buffer each
    assert torch.equal(kept(hidden), head(hidden)) and kept.made == 2  # every position: the head's own forward


def test_a_rollouts_decoding_steps_write_into_one_buffer_a_call(tiny_config, monkeypatch):
    from grpo_lab import Lab
    from grpo_lab.generation import step_logits

    calls, outputs, plain, made = [], [], KeptLogits.__call__, KeptLogits.__init__

    def init(self, head):
        made(self, head)
        calls.append(self)

    def call(self, hidden):  # whether this forward's logits are the kept buffer
        out = plain(self, hidden)
        outputs.append(self.buffer is not None and out.data_ptr() == self.buffer.data_ptr())
        return out

    monkeypatch.setattr(step_logits.KeptLogits, "__init__", init)
    monkeypatch.setattr(step_logits.KeptLogits, "__call__", call)
    lab = Lab(tiny_config(generator={"max_completion_length": 12, "drop_finished_rows": False})).load()
    try:
        head = lab.learner.model.get_output_embeddings()
        torch.manual_seed(3)
        lab.rollout()
    finally:
        lab.close()
    assert "forward" not in head.__dict__  # the head's own forward again after the rollout
    assert len(calls) == 1 and calls[0].made == 1 and calls[0].buffer is None  # one buffer, let go at the end
    assert len(outputs) >= 12 and all(outputs)  # the prefill's and every step's logits in it


def big_allocations(model, kept: bool, rows: int, steps: int, seed: int):
    """A sampled generate() call of `steps` new tokens as generation/hf.py makes it (DecodeStep: the sampler, the
    recorder, the scores let go), the head's kept buffer or its own forward: (its tokens, log-probs, how many blocks
    of at least [rows, vocab] float32 it allocated)."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    from grpo_lab.generation.sampling import DecodeStep, InverseCdfSampler, SampledLogprobs

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (rows, 5), generator=torch.Generator().manual_seed(1))
    step = DecodeStep(SampledLogprobs(steps), InverseCdfSampler(seeds=[seed + r for r in range(rows)]))
    with torch.no_grad(), kept_logits(model, "cpu") if kept else contextlib.nullcontext():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=steps,
                min_new_tokens=steps,
                logits_processor=LogitsProcessorList([step]),
                stopping_criteria=StoppingCriteriaList([step.release]),
                pad_token_id=0,
            )
    sizes = [e.extra_fields.alloc_size for e in events(prof) if e.extra_fields.alloc_size > 0]
    new = out[:, ids.shape[1] :]
    return new, step.recorder.finish(new), sum(size >= rows * vocab * 4 for size in sizes)


def events(prof) -> list:
    found = []

    def walk(node):
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            found.append(node)
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return found


def test_a_decoding_step_allocates_no_block_of_the_vocabulary():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=4000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    rows, steps = 6, 12
    tokens, logprobs, plain = big_allocations(model, False, rows, steps, seed=5)
    kept_tokens, kept_logprobs, kept = big_allocations(model, True, rows, steps, seed=5)
    assert torch.equal(tokens, kept_tokens) and torch.equal(logprobs, kept_logprobs)  # bit for bit
    # the head's own: its logits and generate()'s float32 copy, each step; kept: the one buffer and the step's
    # held row buffers (generation/sampling.py RowBuffers: a float32 and a float64 block of rows), made once
    assert plain >= 2 * steps and kept <= 3, (plain, kept)
