"""The padded backend's decode batch, grown in place instead of copied every step.

`PaddedBackend(decode_layer=InPlaceLayer)`; `Engine` always gives it. Without it the
padded backend uses Hugging Face's own `DynamicLayer`, whose `update` does

    keys = torch.cat([keys, new], dim=-2)        # (B, H_kv, L, D) + (B, H_kv, 1, D)

so every decode step copies the whole batch's KV, per layer, to add one column:
O(B*L) bytes per step, which at L ~ 500 costs as much as a tenth of the forward on a
CPU. Here `keys` / `values` are views of a buffer with SLACK spare columns, and a
step writes its column in place:

    buffer (B, H_kv, L + SLACK, D):   [ k k k k k k k | . . . . ]
    keys = buffer[:, :, :L]                        new column -> L

The buffer is (re)allocated (one copy, what `cat` did at every step) only when the
room runs out, every SLACK steps, or when the backend has replaced `keys` itself
(a row spliced in or removed gives the layer new storage). The values are the same
floats either way: tests/test_padded_backend.py runs one workload both ways.
"""

from __future__ import annotations

from transformers.cache_utils import DynamicLayer


class InPlaceLayer(DynamicLayer):
    """A `DynamicCache` layer that grows into spare room (see the module docstring)."""

    SLACK = 64  # spare columns: the buffer is reallocated once every SLACK steps

    @classmethod
    def from_layer(cls, layer: DynamicLayer) -> InPlaceLayer:
        """The same layer (same tensors, same flags), growing in place from now on."""
        new = cls.__new__(cls)
        new.__dict__.update(layer.__dict__)
        new._buf_k = new._buf_v = None
        return new

    def update(self, key_states, value_states, *args, **kwargs):
        """Append (B, H_kv, t, D) keys and values; return the layer's whole keys, values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = (self.keys.shape[-2] if self.keys.numel() else 0), key_states.shape[-2]
        buf = self._buf_k
        if (buf is None or self.keys.data_ptr() != buf.data_ptr()
                or self.keys.shape[:2] != buf.shape[:2] or n + t > buf.shape[-2]):
            B, H, _, D = key_states.shape
            self._buf_k = key_states.new_empty(B, H, n + t + self.SLACK, D)
            self._buf_v = value_states.new_empty(B, H, n + t + self.SLACK, D)
            if n:
                self._buf_k[:, :, :n] = self.keys
                self._buf_v[:, :, :n] = self.values
        self._buf_k[:, :, n:n + t] = key_states
        self._buf_v[:, :, n:n + t] = value_states
        self.keys, self.values = self._buf_k[:, :, :n + t], self._buf_v[:, :, :n + t]
        return self.keys, self.values
