"""The CUDA stand-ins the Megatron-Core probes (tests/megatron_states_probe.py, tests/megatron_params_probe.py) run
under on a machine without a GPU, in one place. ../shared/consumers/README.md allows a test to stand in for exactly
the calls that need a GPU and to name them; these are they."""

from __future__ import annotations


def device_for_cuda(torch, device: str):
    """Puts what Megatron makes on the GPU on ``device`` (``"cpu"``, or ``"meta"`` for tensors that hold no values):
    ``torch.cuda.current_device`` returns it, a ``TorchFunctionMode`` moves every tensor created with ``device="cuda"``
    there and makes ``Tensor.cuda()`` the identity, and ``Tensor.type()`` answers the CUDA type name
    (``torch.cuda.BFloat16Tensor``), which Megatron's optimizers check their parameters against
    (``distrib_optimizer.py``, ``optimizer.py``). Returns the mode, not entered."""
    from torch.overrides import TorchFunctionMode

    torch.cuda.current_device = lambda: device

    class DeviceForCuda(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "cuda" in str(kwargs.get("device", "")):
                kwargs["device"] = device
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                return func(*args).replace("torch.", "torch.cuda.", 1)
            return func(*args, **kwargs)

    return DeviceForCuda()


def no_cuda_streams(torch) -> None:
    """``torch.cuda.Stream`` as a placeholder: Megatron's DDP makes a communication stream for partial distributed
    optimizers (core_v0.16.1 ``distributed_data_parallel.py``, ``num_distributed_optimizer_instances > 1``) and uses it
    only with ``overlap_grad_reduce`` (``param_and_grad_buffer.py`` ``start_grad_sync``), which the probes leave off."""
    class Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            raise AssertionError("the probe's stand-in stream was used: overlap_grad_reduce is meant to be off")

    torch.cuda.Stream = Stream
