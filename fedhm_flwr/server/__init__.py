"""The server: Flower-free methods (``methods``: cut a level, merge replies, recover, costs) and the one
Flower strategy that runs a round with its collaborators passed in (``strategy``, ``nodes``,
``untrusted``, ``report``, ``evaluation``); ``registry`` maps ``method.name`` to both."""
