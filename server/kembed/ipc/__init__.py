"""What crosses between the front ends and the engine: the frames on the engine's socket
(``protocol``) and the board in shared memory (``board``). Both sides import it; it imports only
``policy`` (the priority classes) and ``domain`` (the failures a frame carries)."""
