from scheduler_svc.server import main

raise SystemExit(main())
