from swarmroute.cli import main

raise SystemExit(main())
