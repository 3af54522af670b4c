from client.bench import main

raise SystemExit(main())
