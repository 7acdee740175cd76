"""The replica runtime inside a worker actor: calls into the user's model (``user_model``), the TensorFlow import's set-up (``tf_logs``, ``keras_preload``) and the TF1 graph runtime (``tf1``)."""
