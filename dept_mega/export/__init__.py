"""Export of a trained source model (one source's embeddings + the shared body) to other formats,
and the import of a Hugging Face model as a checkpoint to start runs from.

* ``checkpoint_reader`` — the ONLY module that knows how a checkpoint lies on disk: it turns
  ``RUN/checkpoints/step_N`` into full (unsharded) fp32 tensors named as in a single-stage model.
* ``hf_mapping`` — which Hugging Face ``transformers`` architecture expresses the model, and the
  weight layout conversion (refuses configurations none expresses, naming the config key).
* ``hf_tokenizer`` — a SentencePiece model as a ``transformers`` (``tokenizers``) tokenizer.
* ``convert`` — the command ``tools/convert_to_hf.py`` (see docs/launching.md, "Export").
* ``hf_dir``, ``hf_import``, ``import_run`` — the inverse: a local Hugging Face directory read,
  its model keys and weights in our layout, and the command ``tools/convert_from_hf.py``
  (docs/launching.md, "Start from Hugging Face weights").
"""
