"""The actors' lifecycle: the worker group (``cluster``) and its live shape (``topology``), room on the Ray
cluster (``room``) and where actors go (``placement``), replacing dead actors (``replacement``), resizing
(``resizing``), the parameter-server group (``server_group``) and its slots (``server_slots``)."""
