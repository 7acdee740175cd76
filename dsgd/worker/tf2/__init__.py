"""The TF2 replica runtime: eager replicas (dsgd.TF2Model, Keras 3) stepped by traced tf.functions."""
