"""Speculative decoding across a route (issue #20): the tail's acceptance rule and the window sizer (``policy``),
where drafts come from (``drafts``), verify windows taken in number order on every hop (``windows``), and the
head's decode loop in verify windows (``verify_loop``)."""
