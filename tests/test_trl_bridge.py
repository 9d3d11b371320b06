"""grpo_lab.trl_bridge on a real TRL GRPOTrainer (CPU): no DataParallel, reference placed, TRL's phases watched."""

import pytest
import torch

from grpo_lab import LabError
from grpo_lab.trl_bridge import prepare_trainer


@pytest.fixture
def trainer(tiny_model, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from grpo_lab.algo.rewards import format_reward, length_reward
    from grpo_lab.data.arithmetic import arithmetic_problems

    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=12,
        max_steps=2,
        beta=0.04,
        logging_steps=1,
        disable_tqdm=True,
    )
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in arithmetic_problems(16)]
    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model),
        args=args,
        reward_funcs=[format_reward, length_reward],
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(tiny_model),
    )


def test_n_gpu_2_wraps_without_the_bridge_and_not_with_it(trainer):
    trainer.args._n_gpu = 2
    assert isinstance(trainer._wrap_model(trainer.model), torch.nn.DataParallel)  # what P1 users hit
    with prepare_trainer(trainer):
        assert trainer._wrap_model(trainer.model) is trainer.model
    assert trainer.args._n_gpu == 2  # restored on exit


def test_already_wrapped_model_is_unwrapped(trainer):
    trainer.model_wrapped = torch.nn.DataParallel(trainer.model)
    with prepare_trainer(trainer):
        assert trainer.model_wrapped is trainer.model


def test_training_under_the_bridge_has_trls_phases_and_a_memory_table(trainer):
    with prepare_trainer(trainer, sample_hz=50) as watch:
        trainer.train()
    assert {"generate", "rewards", "logprobs", "loss", "backward", "optimizer"} <= set(watch.phases())
    assert "generate" in watch.table(0) and watch.memory.total > 0
    assert "_generate" not in trainer.__dict__  # methods restored


def test_reference_model_is_put_in_eval_and_frozen_then_restored(trainer):
    ref = trainer.ref_model
    ref.train()
    ref.requires_grad_(True)
    with prepare_trainer(trainer):
        assert not ref.training and not any(p.requires_grad for p in ref.parameters())
        assert next(ref.parameters()).device == next(trainer.model.parameters()).device
    assert ref.training and all(p.requires_grad for p in ref.parameters())


def test_reference_model_without_weights_is_refused(trainer):
    trainer.ref_model = trainer.ref_model.to("meta")
    with pytest.raises(LabError, match="reference model: it is on the meta device"):
        with prepare_trainer(trainer):
            pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reference_on_the_cpu_is_moved_to_the_policys_gpu(trainer):
    trainer.model.to("cuda:0")
    trainer.ref_model.to("cpu")
    with prepare_trainer(trainer):
        assert next(trainer.ref_model.parameters()).device == torch.device("cuda:0")
