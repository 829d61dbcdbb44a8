"""The engine thread's room: the thread itself (thread.py), what the UI may ask of it (commands.py), the
requests it holds back for a later step (delayed.py), and how it builds engines (factory.py).

The UI never touches the engine; it sends commands here and draws the messages that come back.
"""
