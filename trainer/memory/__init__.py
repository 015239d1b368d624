"""Memory-lean training and the measurement of what a rank holds.

``chunked_loss`` (the output layer and cross-entropy N tokens at a time, no float32 logits of
the whole sequence), ``activation_offload`` (tensors saved for backward in pinned host memory),
``host_allocator`` (host memory returned to the system when a tensor is freed) and ``peaks``
(each phase's measured peak, what ``jobgen plan`` predicts).
"""
