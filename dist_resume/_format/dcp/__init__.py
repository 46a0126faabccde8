"""A DCP folder's ``.metadata``, read without torch's classes and checked against the folder before a byte of data.

One concept per module, in the order a check uses them: ``peek`` (the pickle read with stand-ins, torch-free),
``storage`` (where each entry's bytes are), ``cover`` (every element of a tensor covered exactly once), ``view`` (what
``.metadata`` promises, as plain typed entries, checked against the folder's files), ``entries`` (each stored entry's
header against that promise).
"""
