"""What a modeling module's source says of its kernels (hf_ring.patches.kernel_source): pure, on source text."""
import textwrap

from hf_ring.patches import kernel_source

SOURCE = textwrap.dedent('''
    import torch
    from ...integrations import use_kernel_func_from_hub_with_fallback, use_kernel_forward_from_hub

    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_delta
    except ImportError:
        fla_delta = None


    @use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "causal_conv1d")
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        return hidden_states


    @use_kernel_forward_from_hub("causal_conv1d_forward")
    def causal_conv1d_forward(conv1d, hidden_states, cache, layer_idx, **kwargs):
        weight = conv1d.weight
        return causal_conv1d_fn(hidden_states, weight)


    def unrelated(x):
        causal_conv1d_fn = x  # a local of the same name reads no kernel
        return causal_conv1d_fn


    class Mixer(torch.nn.Module):
        def forward(self, x, *, cache=None):
            x = causal_conv1d_forward(self.conv, x, cache, 0)
            return fla_delta(x, x, x, x, x)


    class Other(torch.nn.Module):
        def forward(self, x):
            return unrelated(x)
''')


def test_kernels_are_read_from_their_definitions_and_guarded_imports():
    source = kernel_source.read(SOURCE)
    assert source.declared == {"causal_conv1d_fn": "causal_conv1d_fn", "fla_delta": "chunk_gated_delta_rule"}
    assert source.parameters["causal_conv1d_fn"] == ("hidden_states", "weight", "bias", "activation")
    assert source.parameters[("Mixer", "forward")] == ("self", "x", "cache")


def test_a_class_reaches_its_kernels_through_the_module_functions_between():
    source = kernel_source.read(SOURCE)
    assert source.kernels_reached("Mixer") == {"causal_conv1d_fn", "fla_delta"}
    assert source.kernels_reached("Other") == frozenset()  # a local that shadows a kernel's name is no call of it
    assert source.kernels_reached("Absent") == frozenset()


def test_a_module_without_a_source_file_has_none():
    import types

    assert kernel_source.of_module(types.ModuleType("built_at_run_time")) is None
