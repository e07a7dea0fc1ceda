"""``--http-processes N``: HTTP served by front processes, decisions taken in one.

``processes`` starts, watches and stops the front processes; ``service_channel`` carries the
service's calls from a front process to the deciding process and back.
"""
