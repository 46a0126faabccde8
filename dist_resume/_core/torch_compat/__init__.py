"""What dist_resume relies on that torch does not promise, each with why, in one place (checked on torch 2.13).

``private``: torch's private APIs; ``ddp``: DDP's gradient buckets; ``loader``: the DataLoader's (and torchdata's)
internals; ``wording``: what torch's error messages mean. No other module reaches into torch's internals or reads
its wording.
"""
