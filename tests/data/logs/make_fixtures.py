"""Writes the log fixtures of this folder with the frameworks' own format strings, copied verbatim.

Run once (``python tests/data/logs/make_fixtures.py``); the tests read the written files, never this
script. The numbers are chosen, the formats are the frameworks':

* Megatron-LM core_v0.16.1 ``megatron/training/training.py`` lines 2033-2083 (``training_log``),
  ``megatron/training/utils.py`` lines 280-290 (``report_memory``),
  ``megatron/training/theoretical_memory_usage.py`` lines 365-368 (``report_theoretical_memory``),
  ``megatron/training/training.py`` line 1069 (the validation prefix, which the reader must skip).
* torchtitan 0.3.0 ``torchtitan/components/metrics.py`` lines 522-532 (``MetricsProcessor.log``) and
  565-572 (``log_validation``), ``torchtitan/tools/utils.py`` lines 263-274 (``Color``),
  ``torchtitan/tools/logging.py`` (the ``[titan] %(asctime)s - %(name)s - %(levelname)s -`` prefix).
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent
MB = 1024.0 * 1024.0


# --- Megatron-LM: 8 GPUs, tp 4, pp 2, dp 1, 5 iterations, --log-throughput --log-memory-interval 1 -----
class Args:
    train_iters = 5
    skipped_train_samples = 0
    log_throughput = True


def training_line(args, iteration, consumed, elapsed_time_per_iteration, throughput, learning_rate, batch_size,
                  loss, loss_scale, grad_norm, skipped=0, nan=0, when="2026-11-30 18:40:23.123456"):
    args.consumed_train_samples = consumed
    log_string = f" [{when}]"
    log_string += ' iteration {:8d}/{:8d} |'.format(iteration, args.train_iters)
    log_string += ' consumed samples: {:12d} |'.format(args.consumed_train_samples)
    if args.skipped_train_samples > 0:
        log_string += ' skipped samples: {:12d} |'.format(args.skipped_train_samples)
    log_string += ' elapsed time per iteration (ms): {:.1f} |'.format(
        elapsed_time_per_iteration * 1000.0
    )
    if args.log_throughput:
        log_string += f' throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |'
    log_string += f' learning rate: {learning_rate:.6E} |'
    log_string += f' global batch size: {batch_size:5d} |'
    log_string += ' {}: {:.6E} |'.format("lm loss", loss)
    log_string += f' loss scale: {loss_scale:.1f} |'
    if grad_norm is not None:
        log_string += f' grad norm: {grad_norm:.3f} |'
    log_string += ' number of skipped iterations: {:3d} |'.format(skipped)
    log_string += ' number of nan iterations: {:3d} |'.format(nan)
    return log_string


def memory_line(rank, name, allocated, max_allocated, reserved, max_reserved):
    mega_bytes = MB
    string = name + ' memory (MB)'
    string += f" | allocated: {allocated / mega_bytes:.2f}"
    string += f" | max allocated: {max_allocated / mega_bytes:.2f}"
    string += f" | reserved: {reserved / mega_bytes:.2f}"
    string += f" | max reserved: {max_reserved / mega_bytes:.2f}"
    return "[Rank {}] {}".format(rank, string)


def theory_line(weight_and_optimizer_memory, activation_memory, total_memory):
    return (f"Theoretical memory footprints: weight and optimizer={weight_and_optimizer_memory:.2f} MB, "
            f"activation={activation_memory:.2f} MB, total={total_memory:.2f} MB\n")


def megatron() -> str:
    a = Args()
    gib = 2**30
    lines = ["> initializing torch distributed ...", "> building GPTDataset (mock) ...",
             theory_line(14000.25, 9000.5, 23000.75).rstrip("\n")]
    times = [9.8765, 1.2345, 1.2501, 1.2299, 1.2402]  # seconds; iteration 1 carries the warm-up
    tflops = [62.5, 501.2, 495.0, 503.3, 498.8]
    losses = [10.8123, 10.7051, 10.5502, 10.4217, 10.3009]
    for i in range(1, 6):
        lines.append(training_line(a, i, 128 * i, times[i - 1], tflops[i - 1], 1.0e-4, 128, losses[i - 1], 1.0,
                                   3.5 - 0.25 * i, when=f"2026-11-30 18:40:{20 + 2 * i:02d}.000001"))
        for rank, base in ((0, 40.0), (4, 52.0)):  # data-parallel rank 0 of pipeline stages 0 and 1
            peak = (base + (2.0 if i >= 2 else 0.0)) * gib  # optimizer states appear at iteration 2
            lines.append(memory_line(rank, f"(after {i} iterations)", 30.5 * gib, peak, peak + 1.5 * gib,
                                     peak + 2.0 * gib))
    lines.append(" validation loss at iteration 5 on validation set | lm loss value: 1.030000E+01 | "
                 "lm loss PPL: 2.973498E+04 | ")
    return "\n".join(lines) + "\n"


# --- torchtitan: 2 ranks, 4 steps, log_freq 1 ------------------------------------------------------
class Color:
    red = "\033[31m"
    green = "\033[32m"
    yellow = "\033[33m"
    blue = "\033[34m"
    magenta = "\033[35m"
    cyan = "\033[36m"
    reset = "\033[39m"
    orange = "\033[38;2;180;60;0m"
    turquoise = "\033[38;2;54;234;195m"


class NoColor:
    red = green = yellow = blue = magenta = cyan = reset = orange = turquoise = ""


def titan_line(color, step, global_avg_loss, grad_norm, max_reserved_gib, max_reserved_pct, tps, tflops, mfu,
               when):
    mfu_str = f"{mfu:.2f}%" if mfu is not None else "N/A"
    message = (
        f"{color.red}step: {step:2}  "
        f"{color.green}loss: {global_avg_loss:8.5f}  "
        f"{color.orange}grad_norm: {grad_norm:7.4f}  "
        f"{color.turquoise}memory: {max_reserved_gib:5.2f}GiB"
        f"({max_reserved_pct:.2f}%)  "
        f"{color.blue}tps: {round(tps):,}  "
        f"{color.cyan}tflops: {tflops:,.2f}  "
        f"{color.magenta}mfu: {mfu_str}{color.reset}"
    )
    return f"[titan] {when} - root - INFO - {message}"


def titan_validation_line(color, step, loss, max_reserved_gib, max_reserved_pct, tps, when):
    message = (
        f"{color.yellow}validate step: {step:2}  "
        f"{color.green}loss: {loss:7.4f}  "
        f"{color.turquoise}memory: {max_reserved_gib:5.2f}GiB"
        f"({max_reserved_pct:.2f}%)  "
        f"{color.blue}tps: {round(tps):,}{color.reset}"
    )
    return f"[titan] {when} - root - INFO - {message}"


def torchtitan(rank: int, color) -> str:
    capacity_gib = 139.8  # an H200's torch.cuda total_memory in GiB
    reserved = [60.10, 61.25, 61.25, 61.30] if rank == 0 else [58.00, 59.75, 59.80, 59.80]
    tps = [812.4, 4101.2, 4096.0, 4110.7] if rank == 0 else [812.0, 4099.9, 4093.6, 4105.3]
    tflops = [38.51, 412.34, 411.8, 413.02]
    lines = ["[titan] 2026-11-30 18:40:01,100 - root - INFO - Starting job: Llama 3 8B training",
             "[titan] 2026-11-30 18:40:09,200 - root - INFO - CUDA memory usage for model: 15.02GiB(10.74%)"]
    for i in range(4):
        lines.append(titan_line(color, i + 1, 12.25 - 0.5 * i, 3.5 - 0.3 * i, reserved[i],
                                100 * reserved[i] / capacity_gib, tps[i], tflops[i], 100 * tflops[i] / 989.4 if i != 3
                                else None, f"2026-11-30 18:40:{10 + 4 * i:02d},{rank}00"))
    lines.append(titan_validation_line(color, 4, 11.5, 61.3, 100 * 61.3 / capacity_gib, 9000.0,
                                       "2026-11-30 18:40:30,000"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    (HERE / "megatron_pretrain_gpt.log").write_text(megatron())
    (HERE / "torchtitan_rank0.log").write_text(torchtitan(0, Color))
    (HERE / "torchtitan_rank1.log").write_text(torchtitan(1, NoColor))
