"""vSkipper inside upstream SGLang: an out-of-tree model package (vSkipper Sec. 3 on the engine it was built for).

SGLang loads the package named by ``SGLANG_EXTERNAL_MODEL_PACKAGE`` (this one: ``impl.vskipper.sglang_model``)
and registers every module's ``EntryClass`` by class name; a checkpoint whose ``config.json`` names
``VSkipperLlamaForCausalLM`` in ``architectures`` is then served by :mod:`.vskipper_llama`. The harness
writes such a directory next to a Llama-family model (:func:`impl.vskipper.sglang_routed.write_routed_model_dir`:
links to the weights and tokenizer, a ``config.json`` with the architecture and a ``vskipper`` entry naming
the policy) and starts the server with this repository on ``PYTHONPATH``
(:class:`impl.serving.sglang_server.SGLangLaunch` ``external_model_package``).

Only the server process imports this package (it needs ``sglang``); nothing of the harness imports it.
The skip policies are the project's own (:func:`impl.vskipper.skipper.build_skipper`), not rewritten.
"""
