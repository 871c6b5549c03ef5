"""A Hugging Face Trainer run whose loss is computed by flce, beside the same run without it.

    pip install flce-<version>-py3-none-any.whl transformers
    python3 client/python/examples/hf_trainer.py --server=localhost:50051 [--arch llama]

Builds a small random causal LM (``--arch``: llama, mistral, qwen2, qwen3,
gemma2, phi3), patches a copy with ``apply_flce`` — one line — and trains both
copies ``--steps`` optimizer steps with ``transformers.Trainer`` (gradient
accumulation 2, so the Trainer passes ``num_items_in_batch``) on the same
synthetic data. Prints each step's loss from both runs ("step 1  loss flce
6.926042  transformers 6.926042") and the largest difference of any
parameter at the end, then "OK" when it is below 1e-4: AdamW's step
divides each gradient by its own magnitude, so the fp32 rounding of
near-zero gradients moves a parameter by up to ~1e-5 (2.5e-5 seen for
gemma2, bench/RESULTS.md).
"""

import argparse
import copy
import sys
import tempfile

import torch
import transformers

from flce.integrations.transformers import apply_flce

CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"final_logit_softcapping": 5.0, "head_dim": 16, "query_pre_attn_scalar": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
}


def train(model, rows, steps, device):
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=device == "cpu", seed=0, data_seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="localhost:50051")
    parser.add_argument("--arch", choices=sorted(CONFIGS), default="llama")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    config_name, model_name, extra = CONFIGS[args.arch]
    config = getattr(transformers, config_name)(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_implementation="eager", **extra)
    torch.manual_seed(0)
    plain = getattr(transformers, model_name)(config).to(args.device)
    patched = copy.deepcopy(plain)
    loss_fn = apply_flce(patched, args.server)  # the one line

    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(4 * args.steps):
        ids = torch.randint(0, 1000, (64,), generator=gen)
        labels = ids.clone()
        labels[:16] = -100  # a prompt the loss ignores
        rows.append({"input_ids": ids, "labels": labels})

    flce_losses = train(patched, rows, args.steps, args.device)
    torch_losses = train(plain, rows, args.steps, args.device)
    for step, (a, b) in enumerate(zip(flce_losses, torch_losses), 1):
        print(f"step {step}  loss flce {a:.6f}  transformers {b:.6f}")
    drift = max(float((a - b).abs().max()) for a, b in zip(patched.parameters(),
                                                            plain.parameters()))
    print(f"{args.arch}: largest parameter difference after {args.steps} steps: {drift:.2e}")
    print("OK" if drift < 1e-4 else "DIFFERENT")
    loss_fn.close()
    return drift


if __name__ == "__main__":
    sys.exit(0 if main() < 1e-4 else 1)
