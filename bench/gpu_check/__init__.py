"""One prepared GPU check: step costs, capture modes, host floors, identity, synchronisations, SDPA kernels, peak
memory and tokens/s, within a deadline.

    python -m bench.gpu_check                                 # `make gpu-check`: on a GPU, bf16, at most 8 minutes
    python -m bench.gpu_check --pair tiny --device cpu --quick    # the same code path on the tiny random pair

First, within a quarter of the budget (what it leaves goes to the pairs), the step costs (``step_costs``): ms
per forward of random-initialised Qwen2.5-7B and 1.5B in bf16 on the engine's forward path, a draft step and a
verify at each gamma 0 to ``--gamma`` at each of ``--step-cost-batches`` over ``--step-cost-context`` tokens per
row, the real shapes on CUDA and small ones elsewhere (``--step-costs``). Their table, with the device, torch,
dtype and context, goes to NAME_step_costs.json beside the results; ``study.cost.load_step_costs`` reads it, and
``study.cost.replay`` then prices decode forwards from it in place of the roofline.

Second, within a share of what is left (what it leaves goes on), the capture modes
(``capture_modes``): on the largest pair that fits, random-initialised Qwen2.5-7B + 1.5B on CUDA (else 1.5B +
0.5B; ``--capture-check small`` elsewhere), whose weights make the draft agree with the target on a known share
of tokens (``synthetic_pair``), per capture mode (``--capture-modes``, default eager and cudagraph on CUDA, eager
and compile elsewhere): the target's plain tokens/s, speculative tokens/s and the engine's plain (gamma 0) tokens/s
at each of ``--capture-batches`` (1, 8, 32), plain's share of the GPU's memory bandwidth (peak from
``study/cost/gpus.json``, else unknown) and of the bandwidth a large copy reaches on it (``bandwidth``),
speculation's ratio to plain and to the engine's plain at each batch in the same mode, captured over eager at
each batch, the mode's compiles, recompiles after warm-up, graph breaks, distinct shapes and, on CUDA, the memory
its graphs hold; issue 40's GPU goals, each met or not met. A graph break, a recompile after warm-up or, in
cudagraph mode, a graph inductor left uncaptured (with its reason) fails the check, in the next part as in this one.

Third, within a share of what is left (what it leaves goes to the pairs), the host floors (``host_floor``,
``--host-floor``: on CUDA by default): ``bench.host_overhead`` per capture mode on the device, at production depth
and tiny width, written to bench/results/host_overhead_gpu.json, the file the cost model's host floors come from
(the captured one is measured nowhere else). Then beside each capture-mode row the cost model's tokens/s for it on
that GPU (the roofline plus those host floors, ``projected``), measured over projected.

Then for each pair (default: ``qwen-coder-small`` and ``qwen2.5-7b``, those on disk; nothing is fetched, and with
neither on disk the tiny pair runs and the report says so) it chooses the dtype as every command that loads a
pair does (``sidecar.models.dtype_choice``: ``--dtype``, else ``$SIDECAR_DTYPE``, else auto: bf16 on CUDA, on a
CPU the faster of bf16 and fp32 at the target's shapes), prints it with why, then runs these parts in this order:

1. identity: the engine's greedy output at one batch against HF ``generate`` on the target alone, one prompt
   at a time. Each row is identical, diverged at a near-tie (the two tokens' logits within the rounding of
   the dtype at their magnitude: allowed, counted) or a mismatch (fails the check), by the rule the identity
   tests share (``sidecar.decoding.divergence``); every divergence is listed with its position and gap.
2. syncs: device-to-host synchronisations of one decode, per target forward and by source line, next to HF
   generate's per step: on CUDA from the warnings of ``torch.cuda.set_sync_debug_mode("warn")`` plus explicit
   ``torch.cuda.synchronize`` calls, elsewhere the torch calls that would wait on a GPU. A decode over its
   budget (one per target forward plus one per draft forward) fails the check.
3. sdpa: the attention kernels one engine decode runs (profiler), and which SDPA backends alone can run it.
4. memory (CUDA): ``torch.cuda.max_memory_allocated`` of the engine and of HF generate at the largest batch.
5. throughput: tokens/s of HF plain (batched), HF assisted (``assistant_model=``, batch 1 only) and the
   engine under each of ``ENGINE_SCHEDULES`` at each batch size.

A global deadline (``--budget-s``) bounds the whole check: each pair gets an equal share of what is left, each
part a share of its pair's time, and a measurement that would not end in time is skipped and says so. A
measurement in progress is never interrupted, so the check can overrun by at most one of them; the results are
written after each part (marked incomplete until the last), so a machine's time limit loses only the part it
cut off. The check exits
non-zero when a pair fails to load, a part (the step costs and capture modes too) raises, a row mismatches, a
decode syncs over its budget, or a capture mode breaks its graph, recompiles after warm-up or leaves a graph
uncaptured.
Prompts are real news articles when data/news.parquet exists (``make corpus``), else built-in texts.
Writes bench/results/gpu_check.json and .md (other devices, pairs and sizes get suffixed names).
"""
