"""Megatron-Core, imported once in the rank fork server (harness/driver/pool.py) for a run that selects the Megatron
model cases (the default run): ~2 s of CPU per import, otherwise paid by every rank of every launch that reaches
one (seven in the default run).  Nothing it sets at import depends on the rank: Transformer Engine and Apex are
looked up then (absent on CPU either way; the rank's shims register `transformer_engine_torch` alone, and Megatron
looks for `transformer_engine` first).

Its import-time warnings about that are the suite's to silence (suites/_megatron_model.py): here they would print
in the driver's output.  Not installed, or failing to import: the ranks import it, or report why, as before.
"""

import gc
import importlib.util
import warnings

if importlib.util.find_spec("megatron") is not None:
    gc.disable()  # (as harness/rank/preload.py: the collector would walk the import's objects again and again)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
        try:
            import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
            import megatron.core.models.gpt.gpt_model  # noqa: F401
        except Exception:  # a broken install is the suite's to report, on its rows
            pass
    gc.freeze()
    gc.enable()
