"""Building blocks of the decoder: rotary embedding, attention (calls the backend), sampler."""
