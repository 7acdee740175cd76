"""The actors' lifecycle: the worker group (``cluster``), where actors go (``placement``) and the parameter-server group (``server_group``)."""
