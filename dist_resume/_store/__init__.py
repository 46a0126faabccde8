"""Where checkpoints live: a local path or an object-store URL, never confused (``url``); an object on a store
(``remote``), read by byte ranges (``ranges``), written by a streamed upload committed by its last write (``upload``).

Torch-free; fsspec and its backends are imported only when a URL is given (the ``dist_resume[s3]``, ``[gcs]`` and
``[azure]`` extras install them).
"""
