"""The attached window: the App (app.py), its screen, the replay of a watched run, and the panels (widgets/).
It draws the frames the data side (attach/feed/) builds."""
