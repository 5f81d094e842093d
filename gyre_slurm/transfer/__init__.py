"""Moving bytes between cells over the Mooncake Transfer Engine: weights, gradients and KV caches."""
