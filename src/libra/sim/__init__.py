"""The discrete-event simulator: modelled engines, trainers and tools on a simulated clock.

It is one of the two mechanisms that carry out the policies' decisions (the other is `runtime`).
Nothing here reads the wall clock; the same seed gives byte-identical results.
"""
